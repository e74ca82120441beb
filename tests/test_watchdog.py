"""HalMit watchdog: eq. 2-4 by hand, the policy network, the evaluation agent's rules, semantic entropy, the SQuAD
domain agent, the LLM clients against real loopback HTTP servers, and `halwatch watch` end to end."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from halwatch.cli import main
from halwatch.errors import HalwatchError, InputError
from halwatch.watchdog import policy as pol
from halwatch.watchdog.agent import Domain
from halwatch.watchdog.clients import EndpointError, LocalClient, OpenAIClient, yes_probability
from halwatch.watchdog.entropy import entropy_of, semantic_entropy
from halwatch.watchdog.evaluate import faithfulness_label, gqa_label, gqa_score, unigram_f1
from halwatch.watchdog.explore import clean_query, seed_questions
from halwatch.watchdog.store import open_store


# eq. 2-4 on hand-computed values
def test_reward_eq2():
    assert pol.reward(True, 0.5, 1.2) == pytest.approx(0.7)  # no hallucination: Delta H
    assert pol.reward(True, 1.2, 0.5) == pytest.approx(-0.7)
    assert pol.reward(False, 0.5, 1.2, reward_before=0.25) == pytest.approx(4.0)  # |1 / R_{i-1}|
    assert pol.reward(False, 0.5, 1.2, reward_before=-2.0) == pytest.approx(0.5)
    assert pol.reward(False, 0.0, 0.0, reward_before=0.0) == pol.REWARD_CAP  # 1/0 capped
    assert pol.reward(False, 0.0, 0.0, reward_before=0.05) == pol.REWARD_CAP


def test_probabilities_eq3():
    np.testing.assert_allclose(pol.probabilities([1.0, 2.0, 1.0]), [0.25, 0.5, 0.25])
    np.testing.assert_allclose(pol.probabilities([-1.0, 1.0, 1.0]), [0.01 / 2.01, 1 / 2.01, 1 / 2.01])
    np.testing.assert_allclose(pol.probabilities([0.0, 0.0, 0.0]), [1 / 3] * 3)


def test_state_eq4():
    assert pol.state(0.5, 0.0, omega=0.1) == 5  # floor((1 - 0.5) * e^0 / 0.1)
    assert pol.state(0.5, math.log(4), omega=0.1) == 20
    assert pol.state(0.75, 0.0, omega=0.125) == 2
    assert pol.state(1.0, 3.0) == 0 and pol.state(1.2, 1.0) == 0  # identical query: no distance


def test_policy_learns_the_rewarded_transform():
    """Eq. 5-6: the fitted action values move toward the observed rewards, and eq. 3 on them favours the transform
    that earned the most."""
    rng = np.random.default_rng(0)
    states = rng.integers(0, 20, 60)
    actions = rng.integers(0, 3, 60)
    rewards = np.where(actions == 1, 2.0, -0.5)
    policy = pol.Policy(seed=0)
    np.testing.assert_allclose(policy.probabilities(5), [1 / 3] * 3)
    first = policy.fit(states, actions, rewards)
    second = policy.fit(states, actions, rewards)
    assert second < first
    p = policy.probabilities(5)
    assert p[1] > 0.5 and p[1] == max(p)
    random_policy = pol.RandomPolicy(seed=0)
    draws = np.array([random_policy.probabilities(5) for _ in range(50)])
    np.testing.assert_allclose(draws.sum(1), 1.0)
    assert draws.std(0).min() > 0.1  # random: a new draw every step


# the evaluation agent
def test_gqa_rule_by_hand():
    # answer words: the summer theatre ran from 1870 to 1939 (8); reference: 1870 to 1939 (3); common 3
    expected = 2 * 3 / 8 * 1 / (3 / 8 + 1)
    assert unigram_f1("The Summer Theatre ran from 1870 to 1939.", "1870 to 1939") == pytest.approx(expected)
    f1 = 2 * (3 / 8) / (3 / 8 + 1)  # ROUGE-L: the LCS is the same 3 words
    assert gqa_score("The Summer Theatre ran from 1870 to 1939.", ["1870 to 1939"]) == pytest.approx(f1)
    label = gqa_label("The Summer Theatre ran from 1870 to 1939.", ["1870 to 1939"])
    assert not label.hallucinated and label.method == "gqa"  # 0.545 >= 0.5
    assert gqa_label("It was a theatre in Warsaw.", ["1870 to 1939"]).hallucinated  # nothing in common
    assert not gqa_label("from 1870 to 1939", ["wrong", "1870 to 1939"]).hallucinated  # the best reference
    assert gqa_label("", ["x"]).hallucinated


def test_faithfulness_rule():
    context = "Warsaw is the capital of Poland. Its population is 1.7 million."
    assert not faithfulness_label("Warsaw is the capital of Poland.", context).hallucinated
    label = faithfulness_label("Krakow hosted the 2020 Winter Olympics.", context)
    assert label.hallucinated and label.method == "faithfulness" and label.score == 0.0
    assert not faithfulness_label("The context does not mention the Olympics.", context).hallucinated


def test_semantic_entropy_by_hand():
    assert entropy_of([0, 0, 1]) == pytest.approx(-(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3)))
    assert entropy_of([0, 1, 2, 3]) == pytest.approx(math.log(4))
    same = ["It ran from 1870 to 1939.", "It ran from 1870 to 1939.", "It ran from 1870 to 1939"]
    assert asyncio.run(semantic_entropy(same)) == pytest.approx(0.0)
    mixed = ["It ran from 1870 to 1939.", "It ran from 1870 to 1939.", "Bananas are a yellow fruit."]
    assert asyncio.run(semantic_entropy(mixed)) == pytest.approx(entropy_of([0, 0, 1]))


# the target agent's domain
def test_domain_from_squad_titles():
    domain = Domain("Harvard University")  # spaces or underscores
    assert domain.title == "Harvard University" and len(domain.documents) == 30 and len(domain.questions) == 112
    seeds, rest = seed_questions(domain, 10, 0)
    assert len(seeds) == 10 and len(rest) == 102 and not {q.id for q in seeds} & {q.id for q in rest}
    assert [q.id for q in seed_questions(domain, 10, 0)[0]] == [q.id for q in seeds]
    # the retriever finds the paragraph that holds the gold answer for most questions
    from halwatch.data.squad import read_squad

    gold = {q.id: q.context for q in read_squad(titles="Harvard_University")}
    hits = [gold[q.id] in domain.retrieve(q.question, 2) for q in domain.questions[:30]]
    assert np.mean(hits) >= 0.6
    with pytest.raises(InputError, match="no SQuAD article titled 'New York City'; titles: .*Warsaw"):
        Domain("New York City")
    with pytest.raises(InputError, match="empty domain"):
        Domain("  ")


def test_clean_query():
    assert clean_query('"What is X? And also Y?"\nmore') == "What is X?"
    assert clean_query("Question: Where is Z") == "Where is Z"
    assert clean_query("\n\n") == ""


# clients against real loopback servers
@pytest.fixture(scope="module")
def local(smol):
    return LocalClient(scoring_model=smol)


@pytest.fixture(scope="module")
def llm_server(smol):
    from halwatch.serve.common import Running
    from halwatch.serve.llm import build_app

    server = Running(build_app(smol))
    yield server.url + "/v1"
    server.stop()


def test_http_client_against_the_local_model_server(local, llm_server):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]

    async def go():
        client = OpenAIClient(llm_server, model="smollm2-135m")
        try:
            remote = await client.chat(messages, n=2, temperature=0.0, max_tokens=8, top_logprobs=3)
            sampled = await client.chat(messages, n=3, temperature=1.0, max_tokens=8, seed=7)
            return remote, sampled, client.calls
        finally:
            await client.aclose()

    remote, sampled, calls = asyncio.run(go())
    direct = local.complete(messages, n=1, temperature=0.0, max_tokens=8, top_logprobs=3)[0]
    assert calls == 2 and len(remote) == 2 and len(sampled) == 3
    assert remote[0].text == remote[1].text == direct.text and direct.text
    assert remote[0].n_tokens == direct.n_tokens and remote[0].finished == direct.finished
    assert remote[0].logprob == pytest.approx(direct.logprob, abs=1e-4)
    assert remote[0].top_first == pytest.approx(direct.top_first, abs=1e-4) and len(direct.top_first) == 3
    cut = local.complete(messages, n=1, temperature=0.0, max_tokens=2)[0]
    assert not cut.finished and cut.n_tokens == 2  # cut at max_tokens: "length"
    again = local.complete(messages, n=3, temperature=1.0, max_tokens=8, seed=7)
    assert [c.text for c in sampled] == [c.text for c in again]  # seeded sampling is reproducible over HTTP


class _Scripted(BaseHTTPRequestHandler):
    """Replies from a script: a list of (status, delay) per request; counts requests and concurrency."""
    protocol_version = "HTTP/1.1"
    script: list = []
    seen = 0
    in_flight = 0
    most = 0
    lock = threading.Lock()

    def log_message(self, *args):
        return

    def do_POST(self):
        cls = type(self)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with cls.lock:
            status, delay = cls.script[min(cls.seen, len(cls.script) - 1)]
            cls.seen += 1
            cls.in_flight += 1
            cls.most = max(cls.most, cls.in_flight)
        time.sleep(delay)
        body = json.dumps({"choices": [{"message": {"content": "yes"}}]} if status == 200 else {"error": "x"}).encode()
        with cls.lock:
            cls.in_flight -= 1
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def scripted():
    handler = type("Handler", (_Scripted,), {"script": [], "seen": 0, "in_flight": 0, "most": 0,
                                             "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


def _ask(url, n_requests=1, **options):
    async def go():
        client = OpenAIClient(url, backoff=0.01, **options)
        try:
            return await asyncio.gather(*(client.chat([{"role": "user", "content": "hi"}])
                                          for _ in range(n_requests)))
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_http_client_retries_with_backoff(scripted):
    handler, url = scripted
    handler.script = [(503, 0), (429, 0), (200, 0)]
    out = _ask(url, retries=3)
    assert out[0][0].text == "yes" and handler.seen == 3
    assert yes_probability(out[0][0]) == 1.0  # no log-probabilities: read from the text


def test_http_client_gives_up_and_reports(scripted):
    handler, url = scripted
    handler.script = [(503, 0)]
    with pytest.raises(EndpointError, match="no answer after 3 attempts .*HTTP 503"):
        _ask(url, retries=2)
    assert handler.seen == 3
    handler.script, handler.seen = [(400, 0)], 0
    with pytest.raises(EndpointError, match="HTTP 400"):
        _ask(url, retries=2)
    assert handler.seen == 1  # a client error is not retried
    handler.script, handler.seen = [(200, 1.0)], 0
    with pytest.raises(EndpointError, match="Timeout"):
        _ask(url, retries=0, timeout=0.2)


def test_http_client_concurrency_limit(scripted):
    handler, url = scripted
    handler.script = [(200, 0.2)]
    out = _ask(url, n_requests=6, concurrency=2)
    assert len(out) == 6 and handler.seen == 6 and handler.most == 2


def test_unreachable_endpoint_is_a_clear_error():
    with pytest.raises(EndpointError, match="127.0.0.1:9/v1/chat/completions: no answer after 2 attempts .*Connect"):
        _ask("http://127.0.0.1:9/v1", retries=1)


def test_watch_explore_resume_and_check(tmp_path, capsys):
    """`halwatch watch explore` on a real SQuAD domain with the default model; a second run resumes from the
    store; `watch check` gives a JSON verdict; bad inputs are refused without writing anything."""
    store = tmp_path / "bound.db"

    def explore(n, policy="reinforced"):
        return main(["-q", "watch", "explore", "--domain", "Harvard_University", "--store", str(store), "--k", "2",
                     "--paths", "2", "--min-queries", str(n), "--max-queries", str(n), "--max-depth", "3",
                     "--policy", policy])

    assert explore(3) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["evaluated"] == 3 and first["new"] == 3 and sum(first["llm_calls"].values()) >= 6
    db = open_store(str(store))
    events = db.events()
    assert len(events) == 3 and db.count() == sum(e["hallucinated"] for e in events)
    assert db.meta()["domain"] == "Harvard University" and db.meta()["evaluated"] == 3
    assert all(e["method"] in ("gqa", "faithfulness") for e in events)
    assert any(e["depth"] == 1 and e["transform"] in pol.TRANSFORMS for e in events)
    db.close()
    assert explore(4) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["evaluated"] == 4 and second["new"] == 1  # resumed: one more query
    assert explore(5, "random") == 2
    assert "explored with policy = 'reinforced'" in capsys.readouterr().err

    query = "Who founded Harvard University?"
    assert main(["watch", "check", "--store", str(store), "--k", "2", query]) == 0
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["query"] == query and isinstance(verdict["hallucination"], bool)
    assert verdict["case"] in ("centroid", "entropy above", "entropy below", "empty store")
    assert len(verdict["neighbours"]) == min(3, second["boundary_points"])

    # the benchmark harness on held-out questions (after the seed pool), and the Figure 6 curve
    out = tmp_path / "bench.json"
    assert main(["-q", "watch", "bench", "--domain", "Harvard_University", "--store", str(store), "--n-test", "3",
                 "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    result = json.loads(out.read_text())
    assert summary["n_test"] == 3 and set(summary["metrics"]) == {"halmit", "pp", "icl", "selfcheckgpt",
                                                                     "semantic-entropy"}
    seeds, rest = seed_questions(Domain("Harvard_University"), 10, 0)
    assert [r["id"] for r in result["rows"]] == [q.id for q in rest[:3]]
    for r in result["rows"]:
        assert r["label"] == int(gqa_label(r["answer"], next(q.answers for q in rest if q.id == r["id"])).hallucinated)
        assert r["halmit_flag"] == (r["scores"]["halmit"] >= 0.5) and r["scores"]["pp"] > 0
        assert 0 <= r["scores"]["icl"] <= 1 and r["entropy"] <= math.log(2) + 1e-6  # k = 2 from the store
    png = tmp_path / "fig6.png"
    assert main(["watch", "curve", "--store", str(store), "--out", str(png)]) == 0
    curve = json.loads(capsys.readouterr().out)["Harvard University / reinforced"]
    db = open_store(str(store))
    assert curve["entropy"] == pytest.approx([e["entropy"] for e in db.events()], abs=1e-4)
    db.close()
    h = np.array(curve["entropy"])
    assert curve["volatility"] == pytest.approx(np.abs(np.diff(h)).mean(), abs=1e-4) and png.stat().st_size > 1000

    missing = tmp_path / "none.db"
    assert main(["watch", "explore", "--domain", "Atlantis", "--store", str(missing)]) == 2
    assert "no SQuAD article titled 'Atlantis'" in capsys.readouterr().err and not missing.exists()
    assert main(["watch", "check", "--store", "mysql://x", query]) == 2
    assert "unknown store" in capsys.readouterr().err
    assert main(["watch", "explore", "--domain", "Warsaw", "--store", str(tmp_path / "x.db"),
                 "--target", "http://127.0.0.1:9/v1", "--retries", "0", "--max-queries", "1"]) == 2
    assert "no answer after 1 attempts" in capsys.readouterr().err


def test_unknown_client_uri():
    from halwatch.watchdog.clients import open_client

    with pytest.raises(HalwatchError, match="unknown LLM client"):
        open_client("ollama:llama3")
