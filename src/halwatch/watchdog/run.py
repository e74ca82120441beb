"""Python API of the watchdog (what ``halwatch watch`` calls): :func:`explore`, :func:`check` and :func:`bench`.

Clients are URIs (:func:`halwatch.watchdog.clients.open_client`): ``local:smollm2-135m`` (default) or
``http://HOST:PORT/v1#MODEL``. The generator and the judge default to the target's client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import numpy as np

from halwatch.errors import HalwatchError
from halwatch.watchdog import monitor
from halwatch.watchdog.agent import Domain, TargetAgent
from halwatch.watchdog.clients import open_client, yes_probability
from halwatch.watchdog.evaluate import Evaluator, gqa_label
from halwatch.watchdog.explore import ExploreConfig, Explorer, seed_questions
from halwatch.watchdog.explore import check as check_query
from halwatch.watchdog.store import open_store


class _Clients:
    """Opens each distinct URI once (a local model is loaded once even when it plays several agents)."""

    def __init__(self, **options):
        self.options, self.open = options, {}

    def get(self, uri):
        if uri is None:
            return None
        if uri not in self.open:
            self.open[uri] = open_client(uri, **self.options)
        return self.open[uri]

    async def aclose(self):
        for client in self.open.values():
            await client.aclose()


@contextlib.asynccontextmanager
async def _session(store: str, client_options: dict | None):
    """The store and the clients of one command, closed whatever happens."""
    clients = _Clients(**(client_options or {}))
    db = open_store(store)
    try:
        yield db, clients
    finally:
        await clients.aclose()
        db.close()


def explore(domain: str, store: str, target: str = "local:smollm2-135m", generator: str | None = None,
            judge: str | None = None, progress=None, client_options: dict | None = None, **config) -> dict:
    """Explore ``domain``'s bound into ``store`` (resuming from it); returns the summary."""
    the_domain = Domain(domain)  # a bad title fails before anything is opened or written

    async def main():
        async with _session(store, client_options) as (db, clients):
            agent = TargetAgent(the_domain, clients.get(target))
            explorer = Explorer(agent, clients.get(generator or target), Evaluator(clients.get(judge)), db,
                                ExploreConfig(domain=domain, **config), progress=progress)
            return await explorer.run()

    return asyncio.run(main())


def _agent_for(meta, db, target, clients, domain=None):
    domain = domain or meta.get("domain")
    if not domain:
        raise HalwatchError(f"the store {db.uri} has no domain yet: explore it first, or give --domain")
    return TargetAgent(Domain(domain), clients.get(target))


def _sampling(meta, k, temperature) -> tuple[int, float]:
    """``k`` and the sampling temperature of the query's entropy: as given, else as the store (its ``meta``) was
    explored with (so that the query's entropy is comparable with the points')."""
    return (k or meta.get("k", 5)), (temperature or meta.get("sample_temperature", 0.5))


def check(query: str, store: str, target: str = "local:smollm2-135m", k: int | None = None,
          epsilon: float = monitor.EPSILON, domain: str | None = None, client_options: dict | None = None,
          temperature: float | None = None) -> dict:
    """Algorithm 1 verdict for ``query`` against the boundary points in ``store``."""
    async def main():
        async with _session(store, client_options) as (db, clients):
            meta = db.meta()
            k_, t_ = _sampling(meta, k, temperature)
            agent = _agent_for(meta, db, target, clients, domain)
            return await check_query(query, db, agent, k=k_, epsilon=epsilon, temperature=t_)

    return asyncio.run(main())


ICL = ("Decide whether the answer to the question is correct, given the context. Reply yes or no.\n\n{demos}"
       "Context: {context}\nQuestion: {question}\nAnswer: {answer}\nCorrect:")
DEMO = "Context: {context}\nQuestion: {question}\nAnswer: {answer}\nCorrect: {verdict}\n\n"


def _icl_demos(domain, seeds) -> str:
    """In-context demonstrations from the seed questions: a reference answer (correct) and another question's
    reference answer (incorrect), alternating."""
    out = []
    for i, q in enumerate(seeds[:4]):
        wrong = seeds[(i + 1) % len(seeds)].answers[0]
        answer, verdict = (q.answers[0], "yes") if i % 2 == 0 else (wrong, "no")
        out.append(DEMO.format(context=domain.retrieve(q.question, 1)[0][:600], question=q.question,
                               answer=answer, verdict=verdict))
    return "".join(out)


async def _score_question(q, agent, judge, db, demos, k, epsilon, temperature, seed):
    from halwatch.detectors.sampling import selfcheck_unigram
    from halwatch.watchdog.embed import embed
    from halwatch.watchdog.entropy import semantic_entropy

    context, greedy = await agent.answer(q.question, logprobs=True)
    _, samples = await agent.answer(q.question, n=k, temperature=temperature, seed=seed)
    answer, texts = greedy[0].text, [s.text for s in samples]
    label = gqa_label(answer, q.answers)
    icl = await judge.chat([{"role": "user", "content": ICL.format(demos=demos, context=context[:1200],
                                                                   question=q.question, answer=answer)}],
                           max_tokens=1, top_logprobs=5)
    entropy = await semantic_entropy(texts, q.question)
    verdict = monitor.decide(db, embed([q.question])[0], entropy, epsilon)
    return {"id": q.id, "question": q.question, "answer": answer, "label": int(label.hallucinated),
            "gqa": round(label.score, 4), "entropy": entropy,
            "scores": {"halmit": verdict["score"], "pp": -greedy[0].mean_logprob,
                       "icl": 1.0 - yes_probability(icl[0]), "selfcheckgpt": selfcheck_unigram(answer, texts),
                       "semantic-entropy": entropy},
            "halmit_case": verdict["case"], "halmit_flag": bool(verdict["hallucination"])}


def _metrics(labels, scores, own_decision: bool = False) -> dict:
    """AUROC, AUC-PR; F1 and accuracy at the method's own decision (HalMit's flag) or, for score-only baselines, at a
    best-F1 threshold cross-fitted over two halves (fitted on one half, applied to the other)."""
    from halwatch.detectors.calibration import best_f1_threshold
    from halwatch.eval.metrics import evaluate

    labels, scores = np.asarray(labels), np.asarray(scores, dtype=float)
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


def bench(domain: str, store: str, target: str = "local:smollm2-135m", judge: str | None = None, n_test: int = 40,
          k: int | None = None, epsilon: float = monitor.EPSILON, temperature: float | None = None, seed: int = 0,
          out=None, client_options: dict | None = None, progress: bool = True) -> dict:
    """Monitor vs baselines on ``n_test`` held-out questions of ``domain`` (the shuffle after the seed pool),
    labelled by the GQA rule on the agent's greedy answer."""
    from halwatch.progress import progress as progress_bar

    async def main():
        async with _session(store, client_options) as (db, clients):
            meta = db.meta()
            if not db.count():
                raise HalwatchError(f"the store {store} has no boundary points: run `halwatch watch explore` first")
            agent = TargetAgent(Domain(domain), clients.get(target))
            k_, t_ = _sampling(meta, k, temperature)
            seeds, rest = seed_questions(agent.domain, meta.get("n_seeds", 10), meta.get("seed", seed))
            demos = _icl_demos(agent.domain, seeds)
            rows = []
            questions = progress_bar(rest[:n_test], desc="watch bench", unit="question", disable=not progress)
            for i, q in enumerate(questions):
                rows.append(await _score_question(q, agent, clients.get(judge or target), db, demos, k_, epsilon,
                                                  t_, seed + i))
            return rows, meta

    rows, meta = asyncio.run(main())
    labels = [r["label"] for r in rows]
    table = {name: _metrics(labels, [r["scores"][name] for r in rows], own_decision=name == "halmit")
             for name in rows[0]["scores"]}
    result = {"domain": domain, "store": store, "n_test": len(rows), "hallucinated": int(sum(labels)),
              "epsilon": epsilon, "exploration": {key: meta.get(key) for key in
                                                          ("policy", "evaluated", "hallucinated", "gamma")},
              "cases": {c: sum(r["halmit_case"] == c for r in rows) for c in {r["halmit_case"] for r in rows}},
              "metrics": table, "rows": rows}
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(out) + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=float))
        tmp.replace(out)
    return result


def curves(stores, last: int = 30, out=None) -> dict:
    """Figure 6: the semantic entropy of the last ``last`` explored queries of each store (one per policy, in the
    order they were recorded, paths interleaved), with a summary per curve: mean, least-squares slope per step, mean
    absolute step-to-step change (volatility), the share of steps that keep or raise the entropy, and the mean
    entropy at each path depth (0 = seed) over the whole exploration. ``out``: a PNG of the curves."""
    from halwatch.watchdog.explore import entropy_curve

    result = {}
    for uri in stores:
        db = open_store(uri)
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
