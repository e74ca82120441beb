"""HalMit's exploration of an agent's generalization bound (section 3.1, Figure 3) and the monitor's entry point.

The core agent keeps a frontier of queries to ask and works on ``concurrency`` of them at once (asyncio; the clients'
own limits bound the calls). Each query is one step:

1. the target agent answers it once greedily (the answer that is judged) and ``k`` times sampled (temperature
   ``sample_temperature``, 0.5: at 1.0 the 135M default's answers all differ and the entropy is log K on every
   query); the semantic entropy of the ``k`` answers is ``H_i`` (Appendix B);
2. the evaluation agent labels the answers (GQA rule with a reference, else the judge LLM or the faithfulness check
   against the agent's context, or against the domain's passages when the agent does not say what it read);
3. a hallucinated query becomes a boundary point in the store (query, answers, entropy, context, embedding) and is
   **expanded**: the policy's IFSP probabilities (eq. 1, 3) draw ``fanout`` transforms (FT1 deduction, FT2 analogy,
   FT3 induction), and the query-generation agent writes one child query per draw, all in parallel; the children
   join the frontier (section 3.1 step 3-4: "multiple new iterations are generated in parallel in response to each
   exploration path");
4. a grounded query is not expanded: its path ends, and a new path starts in its place from the next seed, or, once
   every seed has started one, from a query generated at random from the domain (a passage drawn at random, the
   query-generation agent asked for a question on it: step 3's "new queries will be randomly generated"); so does a
   path that reaches ``max_depth``;
5. the children's rewards (eq. 2) give their parent's training target (eq. 3 over the siblings) and the policy is
   refitted every ``fit_every`` new rewards (eq. 5-6; :mod:`halwatch.watchdog.policy`).

The exploration starts from ``n_seeds`` seed questions (the domain's questions, shuffled with ``seed``; a corpus
without questions gets generated ones). The frontier is first in, first out and the seeds are queued first, so every
seed is asked before any child query (breadth first: with a 135M agent that hallucinates on most queries, children
asked first would spend the whole budget under the first few seeds). It stops once the share of hallucinated queries
``gamma`` reaches ``gamma_stop`` after ``min_queries``, or at ``max_queries``. Every step is one transaction
in the store; a query whose endpoint call fails after the client's retries is recorded as a failure and the run goes
on (``max_failures`` failures in a row stop it: the endpoint is down). A new run on the same store resumes: its
frontier is the expansions that were not finished.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import time
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from halwatch.errors import HalwatchError
from halwatch.watchdog import monitor
from halwatch.watchdog import policy as pol
from halwatch.watchdog.clients import EndpointError
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


def question_messages(domain: str, passage: str) -> list[dict]:
    """The query-generation agent's chat for a new random query of the domain, asked about one passage."""
    return [{"role": "system", "content": f"You write questions about {domain}. Reply with one question only."},
            {"role": "user", "content": f"Text: {passage[:1500]}\n\nWrite one question that this text answers."}]


@dataclass
class ExploreConfig:
    domain: str
    n_seeds: int = 10  # section 4.2: ten random initial queries per domain
    fanout: int = 3  # transforms drawn per expansion of a hallucinated query
    concurrency: int = 4  # queries explored at once
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
    max_failures: int = 5


def seed_questions(domain, n_seeds: int, seed: int):
    """The seed pool: the first ``n_seeds`` of one seeded shuffle of the domain's questions; the rest of the
    shuffle is what the benchmark tests on."""
    order = random.Random(seed).sample(domain.questions, len(domain.questions))
    return order[:n_seeds], order[n_seeds:]


LEAD_IN = re.compile(r"[^?:]{1,80}:\s+(?=[A-Z])")  # words and a colon before a capitalised question


def clean_query(text: str) -> str:
    """The first line of a generated query, up to its first question mark, without quotes, a label or a lead-in
    sentence ending in a colon."""
    line = next((ln for ln in text.strip().splitlines() if ln.strip()), "").strip().strip('"').strip()
    for prefix in ("New question:", "Question:", "Rewritten question:"):
        if line.lower().startswith(prefix.lower()):
            line = line[len(prefix):].strip()
    if "?" in line:
        line = line[:line.index("?") + 1]
    lead = LEAD_IN.match(line)
    if lead and line.endswith("?"):  # "The answer to the text would be: How did ...?" -> the question
        line = line[lead.end():]
    return line[:300]


@dataclass
class Task:
    """A query waiting in the frontier."""
    query: str
    references: list | None = None
    parent: dict | None = None  # the expanded event (None for a seed or a random query)
    transform: str | None = None
    probabilities: list | None = None


FRESH = "start a new path"  # a frontier entry: the next seed, else a query generated from the domain


class Explorer:
    ATTEMPTS = 3  # tries of the query-generation agent for a query not asked before

    def __init__(self, domain, agent, generator, evaluator, store, embedder, config: ExploreConfig,
                 progress=None, clustering: dict | None = None):
        self.domain, self.agent, self.generator, self.evaluator = domain, agent, generator, evaluator
        self.store, self.embedder, self.config, self.progress = store, embedder, config, progress
        self.clustering = clustering or {"method": "embedding"}
        self.seeds, _ = seed_questions(domain, config.n_seeds, config.seed)
        if not self.seeds and not domain.documents:
            raise HalwatchError(f"the domain {domain.title!r} has neither questions nor passages to start from")
        dim = 2 * embedder.dim + 2
        self.policy = (pol.Policy(dim, seed=config.seed) if config.policy == "reinforced"
                       else pol.RandomPolicy(config.seed))
        self.rng = random.Random(config.seed)
        self.np_rng = np.random.default_rng(config.seed)
        self._lock = asyncio.Lock()
        self._running = 0  # steps under way (so that concurrent workers stop at max_queries)
        self._failed_in_a_row = 0
        self.failed = 0
        store.bind_embedder(embedder)
        self._check_meta()
        self._replay()

    def _check_meta(self) -> None:
        meta = self.store.meta()
        c = self.config
        mine = {"domain": self.domain.title, "policy": c.policy, "k": c.k, "seed": c.seed, "n_seeds": c.n_seeds,
                "fanout": c.fanout, "clustering": self.clustering,
                "answer_tokens": getattr(self.agent, "max_tokens", None)}
        for key, value in mine.items():
            if key in meta and meta[key] != value:
                raise HalwatchError(f"the store was explored with {key} = {meta[key]!r}, not {value!r}: use another "
                                    f"store or the same settings")
        self.store.set_meta(**mine, target=self.agent.name, generator=self.generator.name,
                            sample_temperature=c.sample_temperature)

    # resuming
    def _replay(self) -> None:
        """Counters, the policy's training data and the frontier from the store's events."""
        self.events = self.store.events()
        self.by_id = {e["id"]: e for e in self.events}
        for e in self.events:  # a path is named after its first query
            if e["path"] is None:
                e["path"] = self.by_id[e["parent"]]["path"] if e["parent"] in self.by_id else e["id"]
        self.asked = {e["query"] for e in self.events}
        self.n_hallucinated = sum(e["hallucinated"] for e in self.events)
        self.next_seed = self.store.meta().get("next_seed", 0)
        self.states: dict[int, np.ndarray] = {}  # policy state of each expanded event
        self.children: dict[int, list[dict]] = {}
        for e in self.events:
            if e["parent"] in self.by_id and e["transform"]:
                self.children.setdefault(e["parent"], []).append(e)
        self.frontier: deque = deque([FRESH] * max(0, len(self.seeds) - self.next_seed))  # seeds not asked yet
        for e in self.events:  # expansions a killed run did not finish: expand those queries again
            if self._expandable(e) and e["id"] not in self.children:
                self.frontier.append(e)
        self.rewards_seen = sum(len(v) for v in self.children.values())
        if self.children and isinstance(self.policy, pol.Policy):
            self.policy.fit(*self._training_data())

    def _expandable(self, event) -> bool:
        return bool(event["hallucinated"]) and event["depth"] + 1 < self.config.max_depth

    def _state(self, event) -> np.ndarray:
        """The policy state of an event (recomputed from the store for events of an earlier run)."""
        if event["id"] not in self.states:
            answers = self.store.point(event["id"])["answers"][1:] if event["hallucinated"] else [event["answer"]]
            vectors = self.embedder([event["query"], *answers])
            self.states[event["id"]] = pol.features(vectors[0], vectors[1:], event["entropy"], event["state"])
        return self.states[event["id"]]

    def _training_data(self):
        states, masks, targets = [], [], []
        for parent, kids in self.children.items():
            mask, target = pol.sibling_target([k["transform"] for k in kids], [k["reward"] for k in kids])
            if mask.sum():
                states.append(self._state(self.by_id[parent]))
                masks.append(mask)
                targets.append(target)
        return np.array(states), np.array(masks), np.array(targets)

    @property
    def gamma(self) -> float:
        return self.n_hallucinated / len(self.events) if self.events else 0.0

    def done(self) -> bool:
        c, n = self.config, len(self.events) + self._running
        return n >= c.max_queries or (len(self.events) >= c.min_queries and self.gamma >= c.gamma_stop)

    # new queries
    async def _generate(self, messages, temperature: float = 0.7) -> str:
        out = await self.generator.chat(messages, temperature=temperature, max_tokens=self.config.query_tokens,
                                        seed=self.rng.randrange(1 << 30))
        return clean_query(out[0].text)

    def _claim(self, query: str) -> bool:
        """Reserve a query not asked before (by this run, an earlier one, or a worker now)."""
        if not query or query in self.asked:
            return False
        self.asked.add(query)
        return True

    async def _fresh(self) -> Task | None:
        """A new starting query: the next seed not asked yet, else one generated from a random passage."""
        while self.next_seed < len(self.seeds):
            question = self.seeds[self.next_seed]
            self.next_seed += 1
            if self._claim(question.question):
                return Task(question.question, question.answers or None)
        for _ in range(self.ATTEMPTS):
            if not self.domain.documents:
                break
            query = await self._generate(question_messages(self.domain.title, self.domain.passage(self.rng)))
            if self._claim(query):
                return Task(query)
        return None

    async def _expand(self, event) -> list[Task]:
        """Section 3.1 step 3: draw ``fanout`` transforms with the policy's probabilities and write one child query
        for each, in parallel."""
        probs = np.asarray(self.policy.probabilities(self._state(event)), dtype=float)
        draws = [pol.TRANSFORMS[int(i)] for i in self.np_rng.choice(3, size=self.config.fanout, p=probs / probs.sum())]

        async def child(transform):
            for _ in range(self.ATTEMPTS):
                query = await self._generate(transform_messages(transform, self.domain.title, event["query"]))
                if self._claim(query):
                    return Task(query, None, event, transform, [round(float(p), 4) for p in probs])
            return None

        return [t for t in await asyncio.gather(*(child(t) for t in draws)) if t is not None]

    # one query
    async def step(self, task: Task) -> dict:
        c = self.config
        query, parent = task.query, task.parent
        (context, greedy), (_, samples) = await asyncio.gather(
            self.agent.answer(query),
            self.agent.answer(query, n=c.k, temperature=c.sample_temperature, seed=self.rng.randrange(1 << 30)))
        evidence = context if context is not None else "\n\n".join(self.domain.retrieve(query, 2))
        answer, texts = greedy[0].text, [s.text for s in samples]
        label = await self.evaluator.label(query, answer, evidence, task.references)
        sample_labels = [await self.evaluator.label(query, t, evidence, task.references) for t in texts]
        entropy = await semantic_entropy(texts, query, **self._entropy_options())
        start = self._start(parent) if parent else query
        vectors = self.embedder([query, start, *texts])
        s = pol.state(float(vectors[0] @ vectors[1]), entropy)
        reward = None
        if parent is not None:
            reward = pol.reward(not any(lb.hallucinated for lb in sample_labels), parent["entropy"], entropy,
                                parent["reward"] if parent["reward"] is not None else 1.0)
        event = {"path": parent["path"] if parent else None, "depth": parent["depth"] + 1 if parent else 0,
                 "parent": parent["id"] if parent else None, "query": query, "transform": task.transform,
                 "hallucinated": int(label.hallucinated), "entropy": entropy, "reward": reward, "state": s,
                 "method": label.method, "answer": answer, "probabilities": task.probabilities}
        point = None
        if label.hallucinated:
            point = {"query": query, "answers": [answer, *texts], "entropy": entropy, "context": evidence,
                     "method": label.method}
        async with self._lock:
            event["id"] = self.store.record(event, point, vectors[0] if point else None,
                                            meta={"next_seed": self.next_seed})
            if event["path"] is None:
                event["path"] = event["id"]  # a path is named after its first query
            self.events.append(event)
            self.by_id[event["id"]] = event
            self.n_hallucinated += int(label.hallucinated)
            if label.hallucinated:
                self.states[event["id"]] = pol.features(vectors[0], vectors[2:], entropy, s)
            if parent is not None:
                self.children.setdefault(parent["id"], []).append(event)
                self.rewards_seen += 1
                if self.rewards_seen % c.fit_every == 0 and isinstance(self.policy, pol.Policy):
                    data = self._training_data()
                    await asyncio.to_thread(self.policy.fit, *data)
        return event

    def _entropy_options(self) -> dict:
        if self.clustering["method"] == "entailment":
            return {"method": "entailment", "judge": self.evaluator.judge}
        return {"method": "embedding"}

    def _start(self, event) -> str:
        """The path's initial query P_0 (eq. 4): the root of the event's branch."""
        while event["parent"] in self.by_id:
            event = self.by_id[event["parent"]]
        return event["query"]

    async def _worker(self) -> None:
        while not self.done():
            item, task, event = (self.frontier.popleft() if self.frontier else None), None, None
            try:
                if isinstance(item, dict):  # an event to expand
                    self.frontier.extend(await self._expand(item))
                    continue
                task = await self._fresh() if item is None or item is FRESH else item
                if task is None:
                    if not self._running and not self.frontier:
                        break  # nothing to ask, and no step under way that could add something
                    await asyncio.sleep(0.1)
                    continue
                self._running += 1
                try:
                    event = await self.step(task)
                finally:
                    self._running -= 1
                self._failed_in_a_row = 0
            except EndpointError as exc:
                self.failed += 1
                self._failed_in_a_row += 1
                self.store.record_failure(item["query"] if isinstance(item, dict) else task.query if task else "",
                                          str(exc))
                if self._failed_in_a_row >= self.config.max_failures:
                    raise EndpointError(f"{self._failed_in_a_row} calls in a row failed; the last: {exc}") from None
                continue
            self.frontier.append(event if self._expandable(event) else FRESH)  # expand it, or start a new path
            if self.progress is not None:
                self.progress(self, event)

    async def run(self) -> dict:
        t0 = time.perf_counter()
        before = len(self.events)
        counted = [x for x in (self.agent, self.generator, self.evaluator.judge) if hasattr(x, "calls")]
        clients = {x.name: x for x in counted}
        calls0 = {name: x.calls for name, x in clients.items()}
        await asyncio.gather(*(self._worker() for _ in range(self.config.concurrency)))
        calls = {name: x.calls - calls0[name] for name, x in clients.items()}
        return self.summary(time.perf_counter() - t0, len(self.events) - before, calls)

    def policy_probabilities(self):
        """The transform probabilities of the last expansion."""
        return next((e["probabilities"] for e in reversed(self.events) if e.get("probabilities")), None)

    def summary(self, seconds: float = 0.0, new: int = 0, calls: dict | None = None) -> dict:
        """The exploration so far; ``calls``: LLM calls of this run per client (a client playing several agents
        is counted once)."""
        last = self.policy_probabilities()
        c = self.config
        stopped = ("gamma" if self.gamma >= c.gamma_stop and len(self.events) >= c.min_queries
                   else "max_queries" if len(self.events) >= c.max_queries else "exhausted")
        depths = [e["depth"] for e in self.events]
        return {"domain": self.domain.title, "policy": c.policy, "evaluated": len(self.events), "new": new,
                "boundary_points": self.store.count(), "gamma": round(self.gamma, 4), "stopped": stopped,
                "expanded": len(self.children), "max_depth_reached": max(depths, default=0),
                "failed": self.failed, "last_probabilities": dict(zip(pol.TRANSFORMS, last)) if last else None,
                "llm_calls": calls or {}, "minutes": round(seconds / 60, 2), "config": asdict(c)}


async def check(query: str, store, agent, embedder, k: int = 5, epsilon: float = monitor.EPSILON, seed: int = 0,
                temperature: float = 0.5, entropy_options: dict | None = None) -> dict:
    """Algorithm 1 for a query: the verdict and evidence; samples the agent ``k`` times only when the entropy
    comparison is needed."""
    if not query.strip():
        raise HalwatchError("empty query")
    vector = embedder([query])[0]
    verdict = monitor.decide(store, vector, None, epsilon)
    if verdict["case"] == "needs entropy":
        _, samples = await agent.answer(query, n=k, temperature=temperature, seed=seed)
        texts = [s.text for s in samples]
        verdict = monitor.decide(store, vector, await semantic_entropy(texts, query, **(entropy_options or {})),
                                 epsilon)
        verdict["answers"] = texts
    verdict["query"] = query
    return verdict


def entropy_curve(events, last: int = 30) -> list[float]:
    """Figure 6: the semantic entropy of the last ``last`` explored queries, in order."""
    return [round(float(e["entropy"]), 4) for e in events[-last:] if e["entropy"] is not None
            and not math.isnan(e["entropy"])]
