"""Python API of the watchdog (what ``halwatch watch`` calls): :func:`explore`, :func:`check` and :func:`bench`.

Clients are URIs (:func:`halwatch.watchdog.clients.open_client`): ``local:smollm2-135m`` (default) or
``http://HOST:PORT/v1#MODEL``. The agent is the built-in RAG agent over the domain with ``target`` as its LLM, or
``agent``: a black-box OpenAI-compatible endpoint (URI) or any object with the agent protocol
(:mod:`halwatch.watchdog.agent`). The generator and the judge default to the target's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import numpy as np

from halwatch.errors import HalwatchError
from halwatch.files import replaced
from halwatch.watchdog import monitor
from halwatch.watchdog.agent import EndpointAgent, TargetAgent, open_domain
from halwatch.watchdog.clients import open_client, yes_probability
from halwatch.watchdog.embed import embedder as get_embedder
from halwatch.watchdog.evaluate import LABEL_RULES, Evaluator
from halwatch.watchdog.exploration import ExploreConfig, Explorer, seed_questions
from halwatch.watchdog.exploration import check as check_query
from halwatch.watchdog.store import StoreError, open_store


class _Clients:
    """Opens each distinct URI once (a local model is loaded once even when it plays several agents)."""

    def __init__(self, keys=None, **options):
        self.keys, self.options, self.open = keys or {}, options, {}

    def get(self, uri):
        if uri is None:
            return None
        if uri not in self.open:
            self.open[uri] = open_client(uri, keys=self.keys, **self.options)
        return self.open[uri]

    async def aclose(self):
        for client in self.open.values():
            await client.aclose()


@contextlib.asynccontextmanager
async def _session(store: str, client_options: dict | None, create: bool = False):
    """The store and the clients of one command, closed whatever happens; a store that is not there is created
    only with ``create`` (exploring), the other commands refuse it."""
    clients = _Clients(**(client_options or {}))
    db = open_store(store, create=create)
    try:
        yield db, clients
    finally:
        await clients.aclose()
        db.close()


def _agent(domain, target, agent, clients, answer_tokens: int | None = None):
    """The agent to watch: a user's object, a black-box endpoint, or the built-in RAG agent with ``target``;
    ``answer_tokens`` cuts the answers of the last two (default: theirs)."""
    cut = {"max_tokens": int(answer_tokens)} if answer_tokens else {}
    if agent is None:
        return TargetAgent(domain, clients.get(target), **cut)
    if isinstance(agent, str):
        return EndpointAgent(clients.get(agent), **cut)
    if not callable(getattr(agent, "answer", None)) or not hasattr(agent, "name"):
        raise HalwatchError("an agent needs a name and an async answer(query, n, temperature, seed, logprobs)")
    return agent


def _clustering(judge: str | None) -> dict:
    """How semantic entropy clusters answers: by bidirectional entailment when a judge is given, else by the
    cosine rule (the labelled fallback)."""
    if judge:
        return {"method": "entailment", "judge": judge}
    return {"method": "embedding", "note": "fallback: all-MiniLM-L6-v2 cosine >= 0.85 (no --judge)"}


def _entropy_options(meta: dict, clients) -> dict:
    clustering = meta.get("clustering") or {"method": "embedding"}
    if clustering["method"] == "entailment":
        return {"method": "entailment", "judge": clients.get(clustering["judge"])}
    return {"method": "embedding"}


def calibrate(db, embedder, events=None) -> dict:
    """Calibrate ``epsilon`` on the store's explored queries (:func:`monitor.calibrate_epsilon`) and record it."""
    events = db.events() if events is None else events
    point_ids, point_vectors = db.vectors()
    record = monitor.calibrate_epsilon([e["hallucinated"] for e in events], embedder([e["query"] for e in events]),
                                       [e["id"] for e in events], point_ids, point_vectors)
    record["embedder"] = embedder.name
    db.set_meta(epsilon=record)
    return record


def explore(domain: str | None, store: str, target: str = "local:smollm2-135m", generator: str | None = None,
            judge: str | None = None, progress=None, client_options: dict | None = None, agent=None, corpus=None,
            seeds=None, embedder: str | None = None, answer_tokens: int | None = None, **config) -> dict:
    """Explore the bound of an agent over a domain into ``store`` (resuming from it); returns the summary.
    ``domain``: a SQuAD article title, or the title of ``corpus`` (a folder of documents); ``seeds``: a file of
    initial queries; ``agent``: see the module's docstring; ``embedder``: a sentence-transformers folder (default
    all-MiniLM-L6-v2); ``answer_tokens``: where the agent's answers are cut (recorded: check and bench answer
    alike)."""
    the_domain = open_domain(domain, corpus, seeds)  # bad input fails before anything is opened or written
    the_embedder = get_embedder(embedder)

    async def main():
        async with _session(store, client_options, create=True) as (db, clients):
            the_agent = _agent(the_domain, target, agent, clients, answer_tokens)
            gen = clients.get(generator or target)
            explorer = Explorer(the_domain, the_agent, gen, Evaluator(clients.get(judge)), db, the_embedder,
                                ExploreConfig(domain=the_domain.title, **config), progress=progress,
                                clustering=_clustering(judge))
            summary = await explorer.run()
            summary["epsilon"] = calibrate(db, the_embedder, explorer.events)
            summary["embedder"] = the_embedder.record()
            return summary

    return asyncio.run(main())


def _store_embedder(meta, embedder: str | None):
    """The embedder of a store: ``embedder`` when given (the store refuses another), else the one it recorded."""
    return get_embedder(embedder or (meta.get("embedder") or {}).get("name"))


def _epsilon(meta, epsilon) -> float:
    """``epsilon`` as given, else the store's calibrated one, else the paper's 0.8."""
    if epsilon is not None:
        return float(epsilon)
    return float((meta.get("epsilon") or {}).get("value", monitor.EPSILON))


def _sampling(meta, k, temperature) -> tuple[int, float]:
    """``k`` and the sampling temperature of the query's entropy: as given, else as the store (its ``meta``) was
    explored with (so that the query's entropy is comparable with the points')."""
    return (k or meta.get("k", 5)), (temperature or meta.get("sample_temperature", 0.5))


def _the_agent(meta, db, target, agent, clients, domain=None, corpus=None, answer_tokens=None):
    """The agent of ``check``: as :func:`_agent`, the built-in one over the store's domain unless told otherwise,
    its answers cut where the store's were unless ``answer_tokens`` says otherwise."""
    answer_tokens = answer_tokens or meta.get("answer_tokens")
    if agent is not None:
        return _agent(None, target, agent, clients, answer_tokens)
    domain = domain or meta.get("domain")
    if not domain and not corpus:
        raise HalwatchError(f"the store {db.uri} has no domain yet: explore it first, or give --domain")
    return _agent(open_domain(domain, corpus), target, None, clients, answer_tokens)


def _open_points(db, embedder: str | None):
    """The store's ``meta`` and its embedder bound to it (:func:`_store_embedder`), for reading its boundary points;
    a store without any is refused."""
    if not db.count():
        raise StoreError(f"the store {db.uri} has no boundary points: run `halwatch watch explore` first")
    meta = db.meta()
    the_embedder = _store_embedder(meta, embedder)
    db.bind_embedder(the_embedder)
    return meta, the_embedder


def check(query: str, store: str, target: str = "local:smollm2-135m", k: int | None = None,
          epsilon: float | None = None, domain: str | None = None, client_options: dict | None = None,
          temperature: float | None = None, agent=None, corpus=None, embedder: str | None = None,
          answer_tokens: int | None = None) -> dict:
    """Algorithm 1 verdict for ``query`` against the boundary points in ``store``."""
    if not query.strip():
        raise HalwatchError("empty query")

    async def main():
        async with _session(store, client_options) as (db, clients):
            meta, the_embedder = _open_points(db, embedder)
            k_, t_ = _sampling(meta, k, temperature)
            the_agent = _the_agent(meta, db, target, agent, clients, domain, corpus, answer_tokens)
            return await check_query(query, db, the_agent, the_embedder, k=k_, epsilon=_epsilon(meta, epsilon),
                                     temperature=t_, entropy_options=_entropy_options(meta, clients))

    return asyncio.run(main())


ICL = ("Decide whether the answer to the question is correct, given the context. Reply yes or no.\n\n{demos}"
       "Context: {context}\nQuestion: {question}\nAnswer: {answer}\nCorrect:")
DEMO = "Context: {context}\nQuestion: {question}\nAnswer: {answer}\nCorrect: {verdict}\n\n"


def _icl_demos(domain, seeds) -> str:
    """In-context demonstrations from the seed questions: a reference answer (correct) and another question's
    reference answer (incorrect), alternating."""
    out = []
    seeds = [q for q in seeds if q.answers]
    for i, q in enumerate(seeds[:4]):
        wrong = seeds[(i + 1) % len(seeds)].answers[0]
        answer, verdict = (q.answers[0], "yes") if i % 2 == 0 else (wrong, "no")
        out.append(DEMO.format(context=domain.retrieve(q.question, 1)[0][:600], question=q.question,
                               answer=answer, verdict=verdict))
    return "".join(out)


async def _score_question(q, agent, domain, judge, db, embedder, demos, k, epsilon, temperature, seed,
                          entropy_options):
    from halwatch.detectors.sampling import selfcheck_unigram
    from halwatch.watchdog.entropy import semantic_entropy

    context, greedy = await agent.answer(q.question, logprobs=True)
    _, samples = await agent.answer(q.question, n=k, temperature=temperature, seed=seed)
    context = context if context is not None else "\n\n".join(domain.retrieve(q.question, 2))
    answer, texts = greedy[0].text, [s.text for s in samples]
    labels = {name: rule(answer, q.answers) for name, rule in LABEL_RULES.items()}
    icl = await judge.chat([{"role": "user", "content": ICL.format(demos=demos, context=context[:1200],
                                                                   question=q.question, answer=answer)}],
                           max_tokens=1, top_logprobs=5)
    entropy = await semantic_entropy(texts, q.question, **entropy_options)
    verdict = monitor.decide(db, embedder([q.question])[0], entropy, epsilon)
    return {"id": q.id, "question": q.question, "answer": answer, "label": int(labels["gqa"].hallucinated),
            "gqa": round(labels["gqa"].score, 4),
            "labels": {name: int(label.hallucinated) for name, label in labels.items()}, "entropy": entropy,
            "scores": {"halmit": verdict["score"], "pp": -greedy[0].mean_logprob,
                       "icl": 1.0 - yes_probability(icl[0]), "selfcheckgpt": selfcheck_unigram(answer, texts),
                       "semantic-entropy": entropy},
            "halmit_case": verdict["case"], "halmit_flag": bool(verdict["hallucination"])}


def _finite(scores) -> np.ndarray:
    """Scores with a missing value (NaN: e.g. no log-probabilities from the endpoint) set to the median."""
    scores = np.asarray(scores, dtype=float)
    return np.where(np.isfinite(scores), scores, np.nanmedian(scores) if np.isfinite(scores).any() else 0.0)


def _metrics(labels, scores, own_decision: bool = False) -> dict:
    """AUROC, AUC-PR; F1 and accuracy at the method's own decision (HalMit's flag) or, for score-only baselines, at a
    best-F1 threshold cross-fitted over two halves (fitted on one half, applied to the other)."""
    from halwatch.detectors.calibration import best_f1_threshold
    from halwatch.eval.metrics import evaluate

    labels, scores = np.asarray(labels), _finite(scores)
    if own_decision:  # HalMit's score is >= 0.5 exactly when it flags the query
        return evaluate(labels, scores, 0.5)
    halves = [np.arange(len(labels)) % 2 == h for h in (0, 1)]
    preds = np.zeros(len(labels))
    for fit, apply in (halves, halves[::-1]):
        preds[apply] = scores[apply] >= best_f1_threshold(scores[fit], labels[fit])
    result = evaluate(labels, scores, 0.5)
    threshold_free = {k: result[k] for k in ("auroc", "auc_pr")}
    at = evaluate(labels, preds, 0.5)
    return {**at, **threshold_free}


def _label_table(labels, rows) -> dict:
    """Hallucinated count, base rate and every method's metrics under one labelling of the rows (metrics need two
    questions at least: the baselines' thresholds are cross-fitted over two halves), and each method's AUROC with a
    95 % bootstrap interval and its paired difference to the monitor's (``vs_halmit``; both classes needed)."""
    from halwatch.eval.metrics import paired_bootstrap

    table, paired = {}, {}
    if len(rows) >= 2:
        scores = {name: _finite([r["scores"][name] for r in rows]) for name in rows[0]["scores"]}
        table = {name: _metrics(labels, s, own_decision=name == "halmit") for name, s in scores.items()}
        if 0 < sum(labels) < len(labels):
            paired = paired_bootstrap(labels, scores, "halmit")
    return {"hallucinated": int(sum(labels)), "base_rate": round(float(np.mean(labels)), 4) if labels else None,
            "metrics": table, "vs_halmit": paired}


def _done_rows(path: Path | None) -> list[dict]:
    """Rows a stopped ``bench`` already wrote (a half-written last line is dropped)."""
    if path is None or not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def bench(domain: str | None, store: str, target: str = "local:smollm2-135m", judge: str | None = None,
          n_test: int = 40, k: int | None = None, epsilon: float | None = None, temperature: float | None = None,
          seed: int = 0, out=None, client_options: dict | None = None, progress: bool = True, agent=None,
          corpus=None, seeds=None, embedder: str | None = None, answer_tokens: int | None = None) -> dict:
    """Monitor vs baselines on ``n_test`` held-out questions of the domain (the shuffle after the seed pool),
    labelled by the GQA rule on the agent's greedy answer; ``by_label`` has the same figures under the
    answer-containment rule (``evaluate.contains_label``). With ``out``, each question's row is appended to
    ``OUT.rows.jsonl`` as it finishes, and a new run with the same ``out`` goes on from there."""
    from halwatch.progress import progress as progress_bar

    the_domain = open_domain(domain, corpus, seeds)
    rows_path = Path(str(out) + ".rows.jsonl") if out else None
    if rows_path is not None:
        rows_path.parent.mkdir(parents=True, exist_ok=True)

    async def main():
        async with _session(store, client_options) as (db, clients):
            meta, the_embedder = _open_points(db, embedder)
            the_agent = _agent(the_domain, target, agent, clients, answer_tokens or meta.get("answer_tokens"))
            k_, t_ = _sampling(meta, k, temperature)
            eps = _epsilon(meta, epsilon)
            pool, rest = seed_questions(the_domain, meta.get("n_seeds", 10), meta.get("seed", seed))
            rest = [q for q in rest if q.answers]
            if not rest:
                raise HalwatchError("no held-out questions with reference answers: give --seeds with more questions "
                                    "(with answers) than the exploration's seed pool")
            demos = _icl_demos(the_domain, [q for q in pool if q.answers] or rest)
            rows = _done_rows(rows_path)[:n_test]
            done = {r["id"] for r in rows}
            if rows_path is not None:  # rewrite what was kept (drops a half-written line)
                rows_path.write_text("".join(json.dumps(r, default=float) + "\n" for r in rows))
            todo = [q for q in rest[:n_test] if q.id not in done]
            options = _entropy_options(meta, clients)
            for i, q in enumerate(progress_bar(todo, desc="watch bench", unit="question", disable=not progress)):
                row = await _score_question(q, the_agent, the_domain, clients.get(judge or target), db, the_embedder,
                                            demos, k_, eps, t_, seed + len(rows) + i, options)
                rows.append(row)
                if rows_path is not None:
                    with open(rows_path, "a") as f:
                        f.write(json.dumps(row, default=float) + "\n")
            order = {q.id: i for i, q in enumerate(rest)}
            rows.sort(key=lambda r: order.get(r["id"], 0))  # rows from an earlier run first; the held-out order
            return rows, meta, eps

    rows, meta, eps = asyncio.run(main())
    by_label = {name: _label_table([r["labels"][name] for r in rows], rows)
                for name in LABEL_RULES}
    result = {"domain": the_domain.title, "store": store, "n_test": len(rows), **by_label["gqa"], "epsilon": eps,
              "exploration": {key: meta.get(key) for key in ("policy", "fanout", "clustering")},
              "cases": {c: sum(r["halmit_case"] == c for r in rows) for c in sorted({r["halmit_case"] for r in rows})},
              "by_label": {"contains": by_label["contains"]}, "rows": rows}
    if out:
        with replaced(out) as f:
            f.write(json.dumps(result, indent=1, default=float))
    return result


def curves(stores, last: int = 30, out=None) -> dict:
    """Figure 6: the semantic entropy of the last ``last`` explored queries of each store (one per policy, in the
    order they were recorded, paths interleaved), with a summary per curve: mean, least-squares slope per step, mean
    absolute step-to-step change (volatility), the share of steps that keep or raise the entropy, and the mean
    entropy at each path depth (0 = seed) over the whole exploration. ``out``: a PNG of the curves."""
    from halwatch.watchdog.exploration import entropy_curve

    result = {}
    for uri in stores:
        db = open_store(uri, create=False)
        try:
            meta, events = db.meta(), db.events()
        finally:
            db.close()
        h = np.array(entropy_curve(events, last))
        if len(h) < 2:
            raise HalwatchError(f"the store {uri} has fewer than two explored queries")
        steps = np.diff(h)
        name = f"{meta.get('domain')} / {meta.get('policy')}"
        depths = sorted({e["depth"] for e in events if e["depth"] is not None})
        by_depth = {d: [e["entropy"] for e in events if e["depth"] == d] for d in depths}
        result[name] = {"store": uri, "entropy": h.round(4).tolist(), "mean": round(float(h.mean()), 4),
                        "slope": round(float(np.polyfit(np.arange(len(h)), h, 1)[0]), 5),
                        "volatility": round(float(np.abs(steps).mean()), 4),
                        "non_decreasing": round(float((steps >= 0).mean()), 3),
                        "by_depth": {d: {"mean": round(float(np.mean(v)), 4), "n": len(v)}
                                     for d, v in by_depth.items()}}
    if out:
        from halwatch.eval.report import plot_lines

        plot_lines({name: [(i + 1, v, 0.0) for i, v in enumerate(c["entropy"])] for name, c in result.items()},
                   Path(out), "exploration step (last steps)", "semantic entropy (nats)",
                   "Entropy over the final exploration steps (HalMit Fig. 6)")
    return result
