"""HalMit's exploration of an agent's generalization bound (section 3.1) and the monitor's entry point.

The core agent runs ``paths`` exploration paths concurrently (asyncio; the clients' concurrency limits bound the
calls). A path starts from a seed question of the domain (the first ``n_seeds`` of a seeded shuffle of its SQuAD
questions, which carry reference answers) and grows one query per step (eq. 1):

1. the query-generation agent rewrites the path's last query with a fractal transform FT1 deduction, FT2 analogy or
   FT3 induction, drawn with the IFSP probabilities of the policy (section 3.1.2) when the last query was
   hallucinated, uniformly ("new queries randomly generated", step 3) when it was not;
2. the target agent answers it once greedily (the answer that is judged) and ``k`` times sampled (temperature
   ``sample_temperature``, 0.5: at 1.0 the 135M default's answers all differ and the entropy is log K on every
   query): the semantic entropy of the ``k`` answers is ``H_i``;
3. the evaluation agent labels the answers (GQA rule with a reference, else judge or faithfulness); a hallucinated
   query becomes a boundary point in the store, with its answers, entropy, context and embedding;
4. the reward (eq. 2), the state (eq. 4) and the transition feed the policy, refitted every ``fit_every`` steps.

A path restarts from the next seed after ``max_depth`` steps (a seed is answered once; a path that comes back to it
branches from its stored evaluation). ``gamma``, the share of hallucinated queries, stops
the exploration once it reaches ``gamma_stop`` after ``min_queries``, or at ``max_queries``. Every step is one
transaction in the store, and a new run on the same store resumes from its events.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import asdict, dataclass

import numpy as np

from halwatch.errors import HalwatchError
from halwatch.watchdog import monitor
from halwatch.watchdog import policy as pol
from halwatch.watchdog.embed import embed
from halwatch.watchdog.entropy import semantic_entropy

# Each transform: an instruction and the paper's own example pair (section 3.1.1), shown as one chat turn.
MOON = "Did humans really land on the moon in 1969?"
TRANSFORMS = {
    "deduction": ("Ask a more specific follow-up question.",
                  "What were the technological advancements that enabled humans to land on the moon in 1969?"),
    "analogy": ("Ask about a parallel or analogous case.",
                "What historical events in space exploration paralleled the significance of the moon landing in 1969?"),
    "induction": ("Ask a broader, more general question.",
                  "How can we assess the reliability of commonly accepted events in the history of space exploration?"),
}


def transform_messages(transform: str, domain: str, query: str) -> list[dict]:
    """The query-generation agent's chat for one fractal transform (FT1 deduction, FT2 analogy, FT3 induction)."""
    instruction, example = TRANSFORMS[transform]
    return [{"role": "system", "content": f"You rewrite questions about {domain}. {instruction} Reply with one "
                                          f"question only."},
            {"role": "user", "content": f"Rewrite this question: {MOON}"},
            {"role": "assistant", "content": example},
            {"role": "user", "content": f"Rewrite this question: {query}"}]


@dataclass
class ExploreConfig:
    domain: str
    n_seeds: int = 10  # section 4.2: ten random initial queries per domain
    paths: int = 4
    k: int = 5
    gamma_stop: float = 0.6  # section 4.2
    min_queries: int = 20
    max_queries: int = 100
    max_depth: int = 6
    policy: str = "reinforced"  # or "random" (Figure 6's baseline)
    fit_every: int = 8
    seed: int = 0
    query_tokens: int = 40
    sample_temperature: float = 0.5  # at 1.0 the 135M default's K answers all differ: entropy stuck at log K


def seed_questions(domain, n_seeds: int, seed: int):
    """The seed pool: the first ``n_seeds`` of one seeded shuffle of the domain's questions; the rest of the
    shuffle is what the benchmark tests on."""
    order = random.Random(seed).sample(domain.questions, len(domain.questions))
    return order[:n_seeds], order[n_seeds:]


def clean_query(text: str) -> str:
    """The first line of a generated query, up to its first question mark, without quotes or a label."""
    line = next((ln for ln in text.strip().splitlines() if ln.strip()), "").strip().strip('"').strip()
    for prefix in ("New question:", "Question:", "Rewritten question:"):
        if line.lower().startswith(prefix.lower()):
            line = line[len(prefix):].strip()
    if "?" in line:
        line = line[:line.index("?") + 1]
    return line[:300]


class Explorer:
    ATTEMPTS = 3

    def __init__(self, agent, generator, evaluator, store, config: ExploreConfig, progress=None):
        self.agent, self.generator, self.evaluator, self.store, self.config = agent, generator, evaluator, store, config
        self.progress = progress
        self.seeds, _ = seed_questions(agent.domain, config.n_seeds, config.seed)
        if not self.seeds:
            raise HalwatchError(f"the domain {agent.domain.title!r} has no answerable questions to start from")
        self.policy = pol.Policy(seed=config.seed) if config.policy == "reinforced" else pol.RandomPolicy(config.seed)
        self._lock = asyncio.Lock()
        self._running = 0  # steps under way (so that concurrent paths stop at max_queries)
        self._check_meta()
        self._replay()

    def _check_meta(self) -> None:
        meta = self.store.meta()
        mine = {"domain": self.agent.domain.title, "policy": self.config.policy, "k": self.config.k,
                "seed": self.config.seed, "n_seeds": self.config.n_seeds}
        for key, value in mine.items():
            if key in meta and meta[key] != value:
                raise HalwatchError(f"the store was explored with {key} = {meta[key]!r}, not {value!r}: use another "
                                    f"store or the same settings")
        self.store.set_meta(**mine, target=self.agent.client.name, generator=self.generator.name,
                            sample_temperature=self.config.sample_temperature)

    def _replay(self) -> None:
        """Counters, policy transitions and path ends from the store's events (resuming)."""
        self.events = self.store.events()
        self.n_hallucinated = sum(e["hallucinated"] for e in self.events)
        self.transitions = []  # (state, action index, reward)
        self.tails: dict[int, dict] = {}
        by_id = {e["id"]: e for e in self.events}

        def start(e):  # the path's initial query P_0: the seed at the root of the event's branch
            while e["parent"] in by_id:
                e = by_id[e["parent"]]
            return e["query"]

        for e in self.events:
            if e["path"] is None:
                continue
            if e["transform"] and e["parent"] in by_id:
                self.transitions.append((by_id[e["parent"]]["state"], pol.TRANSFORMS.index(e["transform"]),
                                         e["reward"]))
            self.tails[e["path"]] = {**e, "start": start(e)}
        self.seed_events = {e["query"]: {**e, "start": e["query"]} for e in self.events if e["depth"] == 0}
        self.asked = {e["query"] for e in self.events}
        self.next_seed = self.store.meta().get("next_seed", len(self.seed_events))  # seeds drawn so far
        if self.transitions:
            self.policy.fit(*zip(*self.transitions))

    @property
    def gamma(self) -> float:
        return self.n_hallucinated / len(self.events) if self.events else 0.0

    def done(self) -> bool:
        c, n = self.config, len(self.events) + self._running
        return n >= c.max_queries or (n >= c.min_queries and self.gamma >= c.gamma_stop)

    async def _new_query(self, tail, rng):
        """The next query of a path: a seed, or a transform of the path's last query. A query asked before (or being
        asked by another path) is not asked again: the transform is drawn again (``ATTEMPTS`` times), then the path
        restarts from the next seed."""
        c = self.config
        if tail is None or tail["depth"] + 1 >= c.max_depth:
            question = self.seeds[self.next_seed % len(self.seeds)]
            self.next_seed += 1
            if question.question not in self.asked:
                self.asked.add(question.question)
                return question.question, question.answers, None, None, None
            if question.question not in self.seed_events:  # another path is asking it right now
                await asyncio.sleep(0.05)  # (when every seed is in flight, wait for one to be recorded)
                return await self._new_query(None, rng)
            tail = self.seed_events[question.question]  # explored before: branch from it again, do not re-ask it
        probs = self.policy.probabilities(tail["state"]) if tail["hallucinated"] else np.full(3, 1 / 3)
        for _ in range(self.ATTEMPTS):
            transform = pol.TRANSFORMS[int(rng.choice(3, p=probs))]
            out = await self.generator.chat(transform_messages(transform, self.agent.domain.title, tail["query"]),
                                            temperature=0.7, max_tokens=c.query_tokens,
                                            seed=int(rng.integers(1 << 30)))
            query = clean_query(out[0].text)
            if query and query not in self.asked:
                self.asked.add(query)
                return query, None, transform, probs, tail
        return await self._new_query(None, rng)

    async def step(self, path: int, rng) -> dict:
        c = self.config
        query, references, transform, probs, parent = await self._new_query(self.tails.get(path), rng)
        sample_seed = int(rng.integers(1 << 30))
        (context, greedy), (_, samples) = await asyncio.gather(
            self.agent.answer(query),
            self.agent.answer(query, n=c.k, temperature=c.sample_temperature, seed=sample_seed))
        answer = greedy[0].text
        label = await self.evaluator.label(query, answer, context, references)
        sample_labels = [await self.evaluator.label(query, s.text, context, references) for s in samples]
        texts = [s.text for s in samples]
        entropy = await semantic_entropy(texts, query)
        start = parent["start"] if parent else query
        q_vec, start_vec = embed([query, start])
        s = pol.state(float(q_vec @ start_vec), entropy)
        reward = None
        if parent is not None:
            reward = pol.reward(not any(lb.hallucinated for lb in sample_labels), parent["entropy"], entropy,
                                parent["reward"] if parent["reward"] is not None else 1.0)
        event = {"path": path, "depth": parent["depth"] + 1 if parent else 0,
                 "parent": parent["id"] if parent else None,
                 "query": query, "transform": transform, "hallucinated": int(label.hallucinated), "entropy": entropy,
                 "reward": reward, "state": s, "method": label.method, "answer": answer,
                 "probabilities": None if probs is None else [round(float(p), 4) for p in probs]}
        point = None
        if label.hallucinated:
            point = {"query": query, "answers": [answer, *texts], "entropy": entropy, "context": context,
                     "method": label.method}
        async with self._lock:
            n_h = self.n_hallucinated + int(label.hallucinated)
            n = len(self.events) + 1
            event["id"] = self.store.record(event, point, q_vec if point else None,
                                            meta={"evaluated": n, "hallucinated": n_h, "gamma": n_h / n,
                                                  "next_seed": self.next_seed})
            self.events.append(event)
            if parent is None:
                self.seed_events[query] = {**event, "start": query}
            self.n_hallucinated = n_h
            self.tails[path] = {**event, "start": start}
            if transform is not None:
                self.transitions.append((parent["state"], pol.TRANSFORMS.index(transform), reward))
                if len(self.transitions) % c.fit_every == 0:
                    await asyncio.to_thread(self.policy.fit, *zip(*self.transitions))
        return event

    async def _path(self, path: int) -> None:
        rng = np.random.default_rng([self.config.seed, path, len(self.events)])
        while not self.done():
            self._running += 1
            try:
                event = await self.step(path, rng)
            finally:
                self._running -= 1
            if self.progress is not None:
                self.progress(self, event)

    async def run(self) -> dict:
        t0 = time.perf_counter()
        before = len(self.events)
        clients = {id(c): c for c in (self.agent.client, self.generator, self.evaluator.judge) if c is not None}
        calls0 = {k: c.calls for k, c in clients.items()}
        await asyncio.gather(*(self._path(p) for p in range(self.config.paths)))
        calls = {c.name: c.calls - calls0[k] for k, c in clients.items()}
        return self.summary(time.perf_counter() - t0, len(self.events) - before, calls)

    def policy_probabilities(self):
        """The transform probabilities of the last step that drew them from the policy (a hallucinated parent)."""
        hallucinated = {e["id"] for e in self.events if e["hallucinated"]}
        return next((e["probabilities"] for e in reversed(self.events)
                     if e.get("probabilities") and e["parent"] in hallucinated), None)

    def summary(self, seconds: float = 0.0, new: int = 0, calls: dict | None = None) -> dict:
        """The exploration so far; ``calls``: LLM calls of this run per client (a client playing several agents
        is counted once)."""
        last = self.policy_probabilities()
        return {"domain": self.agent.domain.title, "policy": self.config.policy, "evaluated": len(self.events),
                "new": new, "boundary_points": self.store.count(), "gamma": round(self.gamma, 4),
                "stopped": ("gamma" if self.gamma >= self.config.gamma_stop
                            and len(self.events) >= self.config.min_queries
                            else "max_queries" if len(self.events) >= self.config.max_queries else "running"),
                "last_probabilities": dict(zip(pol.TRANSFORMS, last)) if last else None,
                "llm_calls": calls or {}, "minutes": round(seconds / 60, 2),
                "config": asdict(self.config)}


async def check(query: str, store, agent, k: int = 5, epsilon: float = monitor.EPSILON, seed: int = 0,
                temperature: float = 0.5) -> dict:
    """Algorithm 1 for a query: the verdict and evidence; samples the agent ``k`` times only when the entropy
    comparison is needed."""
    if not query.strip():
        raise HalwatchError("empty query")
    vector = embed([query])[0]
    verdict = monitor.decide(store, vector, None, epsilon)
    if verdict["case"] == "needs entropy":
        _, samples = await agent.answer(query, n=k, temperature=temperature, seed=seed)
        texts = [s.text for s in samples]
        verdict = monitor.decide(store, vector, await semantic_entropy(texts, query), epsilon)
        verdict["answers"] = texts
    verdict["query"] = query
    return verdict


def entropy_curve(events, last: int = 30) -> list[float]:
    """Figure 6: the semantic entropy of the last ``last`` explored queries, in order."""
    return [round(float(e["entropy"]), 4) for e in events[-last:] if e["entropy"] is not None
            and not math.isnan(e["entropy"])]
