"""Re-score the ICL prompt judge of a ``watch bench`` result with the fixed yes/no reading (whole words only: "Not",
"None" or "Yesterday" no longer count as no or yes), without exploring again: the judge's prompt is rebuilt from the
stored question and answer, the agent's retrieval (deterministic) and the same four demonstrations.

    python docs/results/smollm2-135m-halmit/rescore_icl.py docs/results/smollm2-135m-halmit/bench-Warsaw.json

rewrites the file's ``icl`` scores and metrics and prints before / after. The stored scores are first reproduced
with the old prefix rule from the same judge replies, which shows that the prompts were rebuilt exactly.
"""

from __future__ import annotations

import asyncio
import json
import sys

from halwatch.watchdog.agent import Domain, TargetAgent
from halwatch.watchdog.clients import LocalClient, yes_probability
from halwatch.watchdog.exploration import seed_questions
from halwatch.watchdog.run import ICL, _icl_demos, _metrics


def old_rule(completion) -> float:
    """The reading before the fix: any first-token alternative that starts with "yes" / "no"."""
    import math

    yes = sum(math.exp(lp) for t, lp in completion.top_first.items() if t.strip().lower().startswith("yes"))
    no = sum(math.exp(lp) for t, lp in completion.top_first.items() if t.strip().lower().startswith("no"))
    if yes + no > 0:
        return yes / (yes + no)
    head = completion.text.strip().lower()
    return 1.0 if head.startswith("yes") else 0.0 if head.startswith("no") else 0.5


async def rescore(path: str) -> None:
    result = json.loads(open(path).read())
    client = LocalClient("smollm2-135m")
    agent = TargetAgent(Domain.squad(result["domain"]), client)
    seeds, _ = seed_questions(agent.domain, 10, 0)
    demos = _icl_demos(agent.domain, seeds)
    before = result["metrics"]["icl"]
    reproduced = 0
    for row in result["rows"]:
        context = "\n\n".join(agent.domain.retrieve(row["question"], agent.k_docs))
        icl = await client.chat([{"role": "user", "content": ICL.format(demos=demos, context=context[:1200],
                                                                        question=row["question"],
                                                                        answer=row["answer"])}],
                                max_tokens=1, top_logprobs=5)
        reproduced += abs((1.0 - old_rule(icl[0])) - row["scores"]["icl"]) < 1e-4
        row["scores"]["icl"] = 1.0 - yes_probability(icl[0])
    labels = [r["label"] for r in result["rows"]]
    result["metrics"]["icl"] = _metrics(labels, [r["scores"]["icl"] for r in result["rows"]])
    open(path, "w").write(json.dumps(result, indent=1, default=float))
    print(path, f"stored ICL scores reproduced by the old rule: {reproduced} of {len(result['rows'])}")
    print(path, "ICL judge before:", {k: round(v, 3) for k, v in before.items()})
    print(path, "ICL judge after: ", {k: round(v, 3) for k, v in result["metrics"]["icl"].items()})


if __name__ == "__main__":
    for name in sys.argv[1:]:
        asyncio.run(rescore(name))
