"""HalMit watchdog: eq. 2-4 by hand, the policy network, the evaluation agent's rules, semantic entropy, the SQuAD
domain agent, the LLM clients against real loopback HTTP servers, and `halwatch watch` end to end."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from halwatch.cli import main
from halwatch.errors import HalwatchError, InputError
from halwatch.watchdog import policy as pol
from halwatch.watchdog.agent import Domain
from halwatch.watchdog.clients import EndpointError, LocalClient, OpenAIClient, yes_probability
from halwatch.watchdog.entropy import entropy_of, semantic_entropy
from halwatch.watchdog.evaluate import contains_label, faithfulness_label, gqa_label, gqa_score, unigram_f1
from halwatch.watchdog.exploration import clean_query, seed_questions
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


def test_sibling_target_eq3():
    mask, target = pol.sibling_target(["analogy", "deduction", "analogy"], [2.0, 1.0, 4.0])
    np.testing.assert_allclose(mask, [1, 1, 0])
    np.testing.assert_allclose(target, [1 / 4, 3 / 4, 0])  # deduction 1, analogy mean(2, 4) = 3
    mask, target = pol.sibling_target(["induction", "deduction"], [-1.0, 0.5])
    np.testing.assert_allclose(target, [0.5 / 0.51, 0, 0.01 / 0.51], rtol=1e-6)  # negative reward clipped at FLOOR


def test_policy_learns_the_rewarded_transform():
    """Eq. 5-6: fitted on sibling targets where analogy always earned most, the policy puts analogy first, also for
    a state it has not seen; before any data it is uniform."""
    rng = np.random.default_rng(0)
    dim = 2 * 384 + 2
    states = rng.normal(size=(40, dim)).astype(np.float32)
    masks, targets = [], []
    for _ in range(40):
        drawn = [pol.TRANSFORMS[j] for j in rng.integers(0, 3, 3)]
        mask, target = pol.sibling_target(drawn, [2.0 if t == "analogy" else -0.5 for t in drawn])
        masks.append(mask)
        targets.append(target)
    policy = pol.Policy(dim, seed=0)
    np.testing.assert_allclose(policy.probabilities(states[0]), [1 / 3] * 3, rtol=1e-6)
    first = policy.fit(states, masks, targets)
    second = policy.fit(states, masks, targets)
    assert second < first
    p = policy.probabilities(rng.normal(size=dim))
    assert p[1] == max(p) and p[1] > 0.4
    random_policy = pol.RandomPolicy(seed=0)
    draws = np.array([random_policy.probabilities(states[0]) for _ in range(50)])
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


def test_contains_rule_by_hand():
    # a right answer in a sentence: GQA calls it hallucinated (F1 = ROUGE-L = 2/16 < 0.5), containment does not
    answer = "The Warsaw Summer Theatre was in operation from the year 1870 until the year 1939."
    assert gqa_label(answer, ["1870"]).hallucinated and not contains_label(answer, ["1870"]).hallucinated
    assert not contains_label("About 1.7 million people.", ["1.7 million"]).hallucinated  # punctuation inside
    assert contains_label("It had 1.7 millions.", ["1.7 million"]).hallucinated  # whole words only
    assert not contains_label("the WARSAW theatre", ["no", "warsaw Theatre"]).hallucinated  # any reference
    assert contains_label("Anything.", [""]).hallucinated and contains_label("", ["x"]).method == "contains"


def test_bench_table_against_scikit_learn():
    """watch bench's figures under one labelling: AUROC as scikit-learn computes it, the monitor judged at its own
    decision (score >= 0.5), a missing score set to the median, the paired differences to the monitor."""
    from sklearn.metrics import f1_score, roc_auc_score

    from halwatch.watchdog.run import _label_table

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 60).tolist()
    halmit, pp = rng.random(60), rng.normal(labels, 1.0)
    pp[3] = np.nan
    rows = [{"scores": {"halmit": h, "pp": p}} for h, p in zip(halmit, pp)]
    table = _label_table(labels, rows)
    filled = np.where(np.isnan(pp), np.nanmedian(pp), pp)
    assert table["hallucinated"] == sum(labels) and table["base_rate"] == round(sum(labels) / 60, 4)
    assert table["metrics"]["pp"]["auroc"] == pytest.approx(roc_auc_score(labels, filled))
    assert table["metrics"]["halmit"]["f1"] == pytest.approx(f1_score(labels, halmit >= 0.5))
    paired = table["vs_halmit"]["pp"]
    assert paired["diff"] == pytest.approx(roc_auc_score(labels, filled) - roc_auc_score(labels, halmit))
    assert paired["ci"][0] < paired["auroc"] < paired["ci"][1] and 0 <= paired["p"] <= 1
    assert _label_table([1, 1], rows[:2])["vs_halmit"] == {}  # one class: no AUROC


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
    domain = Domain.squad("Harvard University")  # spaces or underscores
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
        Domain.squad("New York City")
    with pytest.raises(InputError, match="empty domain"):
        Domain.squad("  ")


def _write_corpus(folder, title="Warsaw", hold_out=0):
    """The paragraphs of one SQuAD article as the user's documents: half as .md files, half in one .jsonl; the last
    ``hold_out`` paragraphs left out. Returns the paragraphs written and those held out."""
    paragraphs = Domain.squad(title).documents
    kept, held = paragraphs[:len(paragraphs) - hold_out], paragraphs[len(paragraphs) - hold_out:]
    folder.mkdir(parents=True, exist_ok=True)
    half = len(kept) // 2
    for i, text in enumerate(kept[:half]):
        (folder / f"doc{i:02d}.md").write_text(f"# Part {i}\n\n{text}\n")
    (folder / "rest.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in kept[half:]))
    (folder / "notes.bin").write_bytes(b"\x00\x01")  # not a document: skipped
    return kept, held


def test_corpus_and_seed_files(tmp_path):
    """--corpus: a folder of .md / .jsonl documents split into passages (every paragraph's text is in one passage);
    --seeds: JSONL with answers or plain lines; malformed files are refused by file and line."""
    from halwatch.watchdog.agent import open_domain, read_seeds, split_passages

    kept, _ = _write_corpus(tmp_path / "docs")
    domain = open_domain(None, tmp_path / "docs")
    assert domain.title == "docs" and domain.questions == []
    joined = " || ".join(domain.documents)
    assert all(" ".join(t.split())[:200] in joined for t in kept)
    assert all(len(d) <= 1700 for d in domain.documents) and len(domain.documents) >= len(kept) // 2
    top = domain.retrieve("What is the capital of Poland?", 1)[0]
    assert "Warsaw" in top
    assert split_passages("a b.\n\n\nc d.") == ["a b. c d."]  # short paragraphs merge
    long = "This is one sentence of text. " * 120
    parts = split_passages(long)
    assert len(parts) >= 2 and all(len(x) <= 1500 for x in parts) and parts[0].endswith(".")

    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text('{"question": "Where is Warsaw?", "answers": ["Poland"]}\n\n'
                     '{"question": "How old is it?", "answer": "old"}\nWho founded it?\n')
    got = read_seeds(seeds)
    assert [(q.question, q.answers) for q in got] == [("Where is Warsaw?", ["Poland"]), ("How old is it?", ["old"]),
                                                      ("Who founded it?", [])]
    assert open_domain("Warsaw", tmp_path / "docs", seeds).title == "Warsaw"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "ok?"}\n{"question": 3}\n')
    with pytest.raises(InputError, match="bad.jsonl:2: needs \"question\""):
        read_seeds(bad)
    bad.write_text('{"question": "ok?"\n')
    with pytest.raises(InputError, match="bad.jsonl:1: not JSON"):
        read_seeds(bad)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "a.jsonl").write_text('{"title": "no text"}\n')
    with pytest.raises(InputError, match="a.jsonl:1: each line needs a \"text\" string"):
        open_domain(None, tmp_path / "broken")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no text found"):
        open_domain(None, tmp_path / "empty")
    with pytest.raises(InputError, match="no such file or folder"):
        open_domain(None, tmp_path / "missing")
    with pytest.raises(InputError, match="give --domain .* or --corpus"):
        open_domain(None, None)


def test_clean_query():
    assert clean_query('"What is X? And also Y?"\nmore') == "What is X?"
    assert clean_query("Question: Where is Z") == "Where is Z"
    assert clean_query("\n\n") == ""
    assert clean_query("The answer to the text would be: How did the city rebuild? Then") == "How did the city rebuild?"
    assert clean_query("What is the 3:2 ratio?") == "What is the 3:2 ratio?"  # no capital after the colon
    assert clean_query("Note: the city was rebuilt.") == "Note: the city was rebuilt."  # not a question: kept


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


def test_http_client_adapts_to_servers_that_differ(smol):
    """Against serve-llm mimicking other servers at once: n ignored (one choice) -> n separate calls with distinct
    seeds; logprobs refused with 400 -> asked again without (nan log-probabilities); max_tokens refused -> sent as
    max_completion_tokens; reply content as a list of parts -> its text."""
    from halwatch.serve.common import Running
    from halwatch.serve.llm import build_app

    server = Running(build_app(smol, quirks=("ignore-n", "refuse-logprobs", "max-completion-tokens",
                                             "content-parts")))
    messages = [{"role": "user", "content": "Name a colour. One word."}]

    async def go():
        client = OpenAIClient(server.url + "/v1", model="smollm2-135m")
        try:
            sampled = await client.chat(messages, n=3, temperature=1.0, max_tokens=6, seed=11, top_logprobs=2)
            calls = client.calls
            again = await client.chat(messages, n=2, temperature=1.0, max_tokens=6, seed=11)
            return sampled, calls, again, client
        finally:
            await client.aclose()

    try:
        sampled, calls, again, client = asyncio.run(go())
    finally:
        server.stop()
    # 1 refused (logprobs) + 1 refused (max_tokens) + 1 answered with one choice + 2 more single calls
    assert calls == 5 and len(sampled) == 3 and all(c.text for c in sampled)
    assert not client.honours_n and not client.logprobs and client.tokens_field == "max_completion_tokens"
    assert all(math.isnan(c.logprob) for c in sampled)
    local = LocalClient(scoring_model=smol)
    direct = [local.complete(messages, n=1, temperature=1.0, max_tokens=6, seed=11 + i)[0].text for i in range(3)]
    assert [c.text for c in sampled] == direct  # seeds seed, seed + 1, seed + 2 over the single calls
    assert [c.text for c in again] == direct[:2]


def test_api_keys_go_only_to_their_endpoint(scripted, monkeypatch, caplog):
    """A key named for one endpoint is sent there and nowhere else; $OPENAI_API_KEY is not sent unless named; a key
    over plain HTTP beyond loopback is warned about; an unset variable is an error."""
    from halwatch.watchdog.clients import open_client

    handler, url = scripted
    handler.script = [(200, 0)]
    monkeypatch.setenv("OPENAI_API_KEY", "sk-global")
    monkeypatch.setenv("AGENT_KEY", "sk-agent")

    async def ask(uri, keys):
        client = open_client(uri, keys=keys)
        try:
            await client.chat([{"role": "user", "content": "hi"}])
        finally:
            await client.aclose()

    asyncio.run(ask(url + "#m", {url: "AGENT_KEY"}))
    asyncio.run(ask(url + "#m", {"http://127.0.0.1:1/v1": "AGENT_KEY"}))
    assert handler.authorizations == ["Bearer sk-agent", None]
    with caplog.at_level("WARNING", logger="halwatch"):
        open_client("http://10.1.2.3:8000/v1#m", keys={"http://10.1.2.3:8000/v1": "AGENT_KEY"})
    assert "sending an API key over plain HTTP to 10.1.2.3" in caplog.text
    with pytest.raises(HalwatchError, match="MISSING_KEY: the environment variable is not set"):
        open_client(url, keys={url: "MISSING_KEY"})


def test_entailment_clustering_with_a_judge(scripted):
    """--judge: answers are clustered by bidirectional entailment, asked of the judge over HTTP: the judge (a
    scripted server) says A and B imply each other, C implies neither: clusters {A, B}, {C}."""
    handler, url = scripted
    # answer 1 vs head 0: yes both ways -> cluster 0; answer 2 vs head 0: no both ways -> a new cluster
    handler.replies = ["yes", "yes", "no", "no"]

    async def go():
        judge = OpenAIClient(url, backoff=0.01)
        try:
            return await semantic_entropy(["1.7 million", "about 1.7 million people", "3.1 million"], "How many?",
                                          method="entailment", judge=judge)
        finally:
            await judge.aclose()

    assert asyncio.run(go()) == pytest.approx(entropy_of([0, 0, 1]))
    assert handler.seen == 4 and "Statement A: about 1.7 million people" in handler.bodies[0]


class _Scripted(BaseHTTPRequestHandler):
    """Replies from a script: a list of (status, delay) per request; counts requests and concurrency."""
    protocol_version = "HTTP/1.1"
    script: list = []
    replies: list = []
    seen = 0
    in_flight = 0
    most = 0
    lock = threading.Lock()

    def log_message(self, *args):
        return

    def do_POST(self):
        cls = type(self)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
        with cls.lock:
            status, delay = cls.script[min(cls.seen, len(cls.script) - 1)]
            reply = cls.replies[cls.seen] if cls.seen < len(cls.replies) else "yes"
            cls.seen += 1
            cls.in_flight += 1
            cls.most = max(cls.most, cls.in_flight)
            cls.authorizations.append(self.headers.get("Authorization"))
            cls.bodies.append(body)
        time.sleep(delay)
        body = json.dumps({"choices": [{"message": {"content": reply}}]} if status == 200 else {"error": "x"}).encode()
        with cls.lock:
            cls.in_flight -= 1
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def scripted():
    handler = type("Handler", (_Scripted,), {"script": [(200, 0)], "replies": [], "seen": 0, "in_flight": 0,
                                             "most": 0, "lock": threading.Lock(), "authorizations": [],
                                             "bodies": []})
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


def _fanout_is_consistent(events, fanout):
    """Only hallucinated queries are expanded, each into at most ``fanout`` children with a transform; depths add
    up; rewards are set exactly for children."""
    by_id = {e["id"]: e for e in events}
    children = {}
    for e in events:
        if e["parent"] is not None:
            parent = by_id[e["parent"]]
            assert parent["hallucinated"] == 1 and e["depth"] == parent["depth"] + 1
            assert e["transform"] in pol.TRANSFORMS and e["reward"] is not None and len(e["probabilities"]) == 3
            children.setdefault(e["parent"], []).append(e)
        else:
            assert e["depth"] == 0 and e["transform"] is None and e["reward"] is None
    assert all(len(kids) <= fanout for kids in children.values())
    assert len({e["query"] for e in events}) == len(events)  # no query asked twice
    return children


def test_watch_explore_resume_and_check(tmp_path, capsys):
    """`halwatch watch explore` on a real SQuAD domain with the default model: fan-out from hallucinated queries,
    the embedder and a calibrated epsilon recorded; a second run resumes from the store; `watch check` gives a JSON
    verdict; `watch bench` writes rows as it goes and resumes; bad inputs are refused without writing anything."""
    store = tmp_path / "bound.db"

    def explore(n, policy="reinforced"):  # short answers keep the test quick; check and bench answer alike
        return main(["-q", "watch", "explore", "--domain", "Harvard_University", "--store", str(store), "--k", "2",
                     "--concurrency", "2", "--fanout", "2", "--min-queries", str(n), "--max-queries", str(n),
                     "--max-depth", "3", "--policy", policy, "--answer-tokens", "16", "--n-seeds", "2"])

    assert explore(4) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["evaluated"] == 4 and first["new"] == 4 and sum(first["llm_calls"].values()) >= 8
    assert first["embedder"]["name"] == "all-MiniLM-L6-v2" and first["epsilon"]["explored"] == 4
    db = open_store(str(store))
    events = db.events()
    assert len(events) == 4 and db.count() == sum(e["hallucinated"] for e in events)
    meta = db.meta()
    assert meta["domain"] == "Harvard University" and meta["embedder"]["dim"] == 384 and meta["answer_tokens"] == 16
    assert meta["epsilon"]["value"] == first["epsilon"]["value"] and meta["clustering"]["method"] == "embedding"
    assert all(e["method"] in ("gqa", "faithfulness") for e in events)
    assert all(len(e["answer"].split()) <= 16 for e in events)  # 16 tokens: at most 16 words
    children = _fanout_is_consistent(events, 2)
    assert first["expanded"] == len(children)
    pool, rest = seed_questions(Domain.squad("Harvard_University"), 2, 0)  # the store's seeds (--n-seeds 2), held out
    seeds = [q.question for q in pool]
    assert {e["query"] for e in events[:2]} == set(seeds)  # every seed before any child (breadth first)
    later = events[2:]
    if any(e["hallucinated"] for e in events[:2]):  # a hallucinated seed was expanded: its children asked next
        assert any(e["parent"] in (events[0]["id"], events[1]["id"]) and e["transform"] for e in later)
    else:  # grounded seeds end their paths: new ones start from queries generated from the domain
        assert all(e["depth"] == 0 and e["query"] not in seeds for e in later)
    db.close()
    # resuming is tested by test_killed_exploration_resumes_without_duplicates_or_losses; another policy is refused
    assert explore(6, "random") == 2
    assert "explored with policy = 'reinforced'" in capsys.readouterr().err
    assert main(["watch", "explore", "--domain", "Harvard_University", "--store", str(store),
                 "--answer-tokens", "0"]) == 2
    assert "--answer-tokens 0: give a positive number" in capsys.readouterr().err

    query = "Who founded Harvard University?"
    if first["boundary_points"]:
        assert main(["watch", "check", "--store", str(store), "--k", "2", query]) == 0
        verdict = json.loads(capsys.readouterr().out)
        assert verdict["query"] == query and isinstance(verdict["hallucination"], bool)
        assert verdict["case"] in ("centroid", "entropy above", "entropy below")
        assert verdict["epsilon"] == first["epsilon"]["value"]
        assert len(verdict["neighbours"]) == min(3, first["boundary_points"])

    # the benchmark harness on held-out questions (after the seed pool), resumable, and the Figure 6 curve
    out = tmp_path / "bench.json"

    def bench(n):
        return main(["-q", "watch", "bench", "--domain", "Harvard_University", "--store", str(store), "--n-test",
                     str(n), "--out", str(out)])

    assert bench(1) == 0
    assert json.loads(capsys.readouterr().out)["metrics"] == {}  # one question: no metrics
    rows_file = Path(str(out) + ".rows.jsonl")
    first_rows = rows_file.read_text()
    assert len(first_rows.splitlines()) == 1
    with open(rows_file, "a") as f:
        f.write('{"id": "half-writ')  # a run killed while writing its next row
    assert bench(2) == 0
    summary = json.loads(capsys.readouterr().out)
    assert rows_file.read_text().startswith(first_rows) and len(rows_file.read_text().splitlines()) == 2
    result = json.loads(out.read_text())
    assert summary["n_test"] == 2 and set(summary["metrics"]) == {"halmit", "pp", "icl", "selfcheckgpt",
                                                                     "semantic-entropy"}
    contains = summary["by_label"]["contains"]
    assert contains["hallucinated"] == sum(r["labels"]["contains"] for r in result["rows"])
    assert set(contains["metrics"]) == set(summary["metrics"])
    assert [r["id"] for r in result["rows"]] == [q.id for q in rest[:2]]
    for r in result["rows"]:
        assert r["label"] == r["labels"]["gqa"] == int(gqa_label(r["answer"], next(
            q.answers for q in rest if q.id == r["id"])).hallucinated)
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
    for command in (["check", query], ["bench", "--domain", "Harvard_University"], ["curve"]):  # a mistyped store
        assert main(["watch", *command, "--store", str(missing)]) == 2
        assert f"no store at {missing}" in capsys.readouterr().err and not missing.exists()
    empty = tmp_path / "empty.db"
    open_store(str(empty)).close()
    assert main(["watch", "check", "--store", f"sqlite:{empty}", query]) == 2
    assert "has no boundary points" in capsys.readouterr().err
    assert main(["watch", "explore", "--domain", "Warsaw", "--store", str(tmp_path / "x.db"),
                 "--target", "http://127.0.0.1:9/v1", "--retries", "0", "--max-queries", "3"]) == 2
    err = capsys.readouterr().err
    assert "5 calls in a row failed" in err and "no answer after 1 attempts" in err
    failed = open_store(str(tmp_path / "x.db"))
    assert len(failed.failures()) == 5 and failed.events() == []  # each failure recorded against its query
    failed.close()
    assert main(["watch", "explore", "--domain", "Warsaw", "--store", str(tmp_path / "y.db"), "--key-env", "oops"]) == 2
    assert "write ENDPOINT=VAR" in capsys.readouterr().err


class CorpusAgent:
    """A user's own agent (the Python protocol): its own keyword retrieval over its own copy of the documents, the
    default model as its LLM; it records the queries it was asked."""

    name = "corpus-agent"

    def __init__(self, paragraphs, client):
        self.paragraphs, self.client, self.asked = paragraphs, client, []

    @property
    def calls(self):
        return self.client.calls

    async def answer(self, query, n=1, temperature=0.0, seed=0, logprobs=False):
        self.asked.append(query)
        words = set(query.lower().split())
        best = max(self.paragraphs, key=lambda p: len(words & set(p.lower().split())))
        messages = [{"role": "user", "content": f"Context: {best}\n\nQuestion: {query}\nAnswer in one sentence."}]
        return best, await self.client.chat(messages, n=n, temperature=temperature, max_tokens=32, seed=seed)


def test_watch_your_own_agent_over_your_corpus(tmp_path, smol, capsys):
    """A black-box agent behind an OpenAI-compatible endpoint (`--agent`, serve-llm ignoring n like Ollama), the
    user's documents (`--corpus`) and seed file (`--seeds`), a PostgreSQL store; the gamma rule stops the
    exploration before max; `watch check --agent` answers. Then a user-defined Python agent on the same corpus."""
    from halwatch.serve.common import Running
    from halwatch.serve.llm import build_app
    from halwatch.watchdog import explore as explore_api  # the function (the module is .exploration)
    from halwatch.watchdog.store import stop_pgserver

    kept, held = _write_corpus(tmp_path / "docs", hold_out=3)
    seeds = tmp_path / "seeds.jsonl"
    warsaw = Domain.squad("Warsaw").questions[:4]
    seeds.write_text("".join(json.dumps({"question": q.question, "answers": q.answers}) + "\n" for q in warsaw))
    server = Running(build_app(smol, quirks=("ignore-n",)))
    agent = server.url + "/v1#smollm2-135m"
    pg = tmp_path / "pg"
    try:
        assert main(["-q", "watch", "explore", "--agent", agent, "--corpus", str(tmp_path / "docs"), "--domain",
                     "Warsaw", "--seeds", str(seeds), "--n-seeds", "2", "--store", f"pgserver:{pg}", "--k", "2",
                     "--fanout", "2", "--concurrency", "2", "--gamma", "0.01", "--min-queries", "2",
                     "--max-queries", "8", "--max-depth", "2", "--answer-tokens", "24"]) == 0
        summary = json.loads(capsys.readouterr().out)
        # the 135M agent answers without any context: it hallucinates early, so gamma >= 0.01 stops the run at min
        assert summary["stopped"] == "gamma" and 2 <= summary["evaluated"] < 8 and summary["gamma"] >= 0.01
        assert summary["llm_calls"][agent] >= 2 * summary["evaluated"]  # greedy + k samples (n ignored: k calls)
        db = open_store(f"pgserver:{pg}")
        try:
            events = db.events()
            assert db.meta()["target"] == agent and events[0]["query"] in {q.question for q in warsaw}
            assert events[0]["method"] == "gqa"  # a seed with a reference answer
            corpus = Domain.corpus(tmp_path / "docs")
            for e in events:  # the agent's context is unknown: answers were judged against the corpus passages
                if e["hallucinated"]:
                    assert db.point(e["id"])["context"] == "\n\n".join(corpus.retrieve(e["query"], 2))
        finally:
            db.close()
        assert main(["watch", "check", "--store", f"pgserver:{pg}", "--agent", agent, "--corpus",
                     str(tmp_path / "docs"), "--domain", "Warsaw", "When did Warsaw's Palace of Culture open?"]) == 0
        verdict = json.loads(capsys.readouterr().out)
        assert verdict["case"] in ("centroid", "entropy above", "entropy below")
    finally:
        server.stop()
        stop_pgserver(pg)
    assert not (pg / "postmaster.pid").exists()

    mine = CorpusAgent(kept, LocalClient(scoring_model=smol))
    result = explore_api(None, str(tmp_path / "mine.db"), agent=mine, corpus=tmp_path / "docs", k=2, fanout=2,
                         concurrency=1, min_queries=2, max_queries=2, max_depth=2, n_seeds=1)
    assert result["evaluated"] == 2 and result["llm_calls"]["corpus-agent"] >= 4
    db = open_store(str(tmp_path / "mine.db"))
    try:
        events = db.events()
        assert sorted({e["query"] for e in events}) == sorted(set(mine.asked)) and len(mine.asked) == 4
        assert db.meta()["target"] == "corpus-agent" and all(e["method"] == "faithfulness" for e in events)
        for e in events:  # the user's agent said what it read: that is the evidence
            if e["hallucinated"]:
                assert db.point(e["id"])["context"] in kept
    finally:
        db.close()


@pytest.mark.parametrize("backend", ["sqlite", "pgserver"])
def test_killed_exploration_resumes_without_duplicates_or_losses(backend, tmp_path):
    """SIGKILL `halwatch watch explore` once it has recorded a query; a second run resumes: no query twice,
    every hallucinated query's point and vector there, and the count goes on from where it stopped."""
    import signal
    import subprocess
    import sys

    from halwatch.watchdog.store import stop_pgserver

    uri = f"sqlite:{tmp_path / 'k.db'}" if backend == "sqlite" else f"pgserver:{tmp_path / 'pg'}"
    args = [sys.executable, "-m", "halwatch", "-q", "watch", "explore", "--domain", "Harvard_University", "--store",
            uri, "--k", "1", "--concurrency", "2", "--fanout", "2", "--max-depth", "3", "--min-queries", "40",
            "--max-queries", "40", "--answer-tokens", "16"]
    watcher = open_store(uri)  # held while the explorer runs: one pgserver server for both processes
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and len(watcher.events()) < 1 and proc.poll() is None:
            time.sleep(1)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        before = watcher.events()
        assert len(before) >= 1, err
        watcher.close()
        assert main(["-q", "watch", "explore", "--domain", "Harvard_University", "--store", uri, "--k", "1",
                     "--concurrency", "2", "--fanout", "2", "--max-depth", "3", "--min-queries",
                     str(len(before) + 2), "--max-queries", str(len(before) + 2), "--answer-tokens", "16"]) == 0
        db = open_store(uri)
        try:
            after = db.events()
            assert [e["id"] for e in after[:len(before)]] == [e["id"] for e in before]
            assert len(after) == len(before) + 2
            _fanout_is_consistent(after, 2)
            assert db.count() == sum(e["hallucinated"] for e in after) and db.integrity() == "ok"
            ids, vectors = db.vectors()
            assert ids == [e["id"] for e in after if e["hallucinated"]] and vectors.shape == (len(ids), 384)
        finally:
            db.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        watcher.close()
        if backend == "pgserver":
            stop_pgserver(tmp_path / "pg")


def test_unknown_client_uri():
    from halwatch.watchdog.clients import open_client

    with pytest.raises(HalwatchError, match="unknown LLM client"):
        open_client("ollama:llama3")
