"""Side by side with the peer: seconds per answer of halwatch's default detector and of LM-Polygraph's white-box
estimators on the same RAGTruth answers, each as a whole process (start-up and model loading included), one run.

- halwatch: ``halwatch score --input answers.jsonl --no-cache`` (the shipped default detector: one teacher-forced
  pass per answer, score and spans; no signal cache, so that every answer runs its pass).
- LM-Polygraph 0.7.0, its own path (``python -m halwatch.eval.peer_speed ANSWERS``): the same scoring model loaded
  by transformers (eager attention, which LM-Polygraph reads), wrapped in its ``WhiteboxModel``; per answer its
  ``GreedyProbsCalculator`` (attention maps on), ``EntropyCalculator``, ``AttentionForwardPassCalculator`` and
  ``AttentionElicitingPromptCalculator``, then every white-box estimator halwatch offers as ``polygraph:NAME``.
  LM-Polygraph estimates the uncertainty of an answer it generates itself (it has no way to score a given one), so
  it generates as many tokens as the given answer has (``max_new_tokens``), greedily, from the same prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_answers(path: Path, n: int = 50, seed: int = 0) -> int:
    """``n`` RAGTruth test answers (a seeded sample) as halwatch's JSONL input; returns how many."""
    from halwatch.data.ragtruth import seeded_sample

    samples = seeded_sample(n, seed)
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps({"id": s.id, "prompt": s.prompt, "response": s.response}) + "\n")
    return len(samples)


def _timed_process(command: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({done.returncode}): {done.stderr[-2000:]}")
    return seconds


def run_peer_speed(n: int = 50, out=print) -> dict:
    """Both processes on the same ``n`` answers; prints seconds per answer and the ratio."""
    from halwatch.detectors.polygraph import installed_version

    version = installed_version()  # a clear error when LM-Polygraph is not installed
    with tempfile.TemporaryDirectory(prefix="halwatch-peer-") as tmp:
        answers = Path(tmp) / "answers.jsonl"
        n = write_answers(answers, n)
        ours = _timed_process([sys.executable, "-m", "halwatch", "score", "--input", str(answers), "--output",
                               str(Path(tmp) / "scores.jsonl"), "--no-cache"])
        peer = _timed_process([sys.executable, "-m", "halwatch.eval.peer_speed", str(answers)])
    row = {"answers": n, "halwatch_s": ours, "polygraph_s": peer, "halwatch_per_answer_s": ours / n,
           "polygraph_per_answer_s": peer / n, "speedup": peer / ours}
    out(f"\n{n} RAGTruth test answers, whole processes (start-up and model loading included):")
    out("| process | seconds | seconds per answer |")
    out("|---|---|---|")
    out(f"| halwatch score (default detector) | {ours:.1f} | {ours / n:.2f} |")
    out(f"| LM-Polygraph {version} (generation + every white-box estimator) | {peer:.1f} | {peer / n:.2f} |")
    out(f"halwatch is {row['speedup']:.2f}x faster per answer")
    return row


def polygraph_process(answers: Path) -> None:
    """LM-Polygraph's own path over every answer of ``answers`` (see the module docstring)."""
    import torch
    from lm_polygraph import WhiteboxModel, estimators
    from lm_polygraph.stat_calculators.attention_eliciting_prompt import AttentionElicitingPromptCalculator
    from lm_polygraph.stat_calculators.attention_forward_pass import AttentionForwardPassCalculator
    from lm_polygraph.stat_calculators.entropy import EntropyCalculator
    from lm_polygraph.stat_calculators.greedy_probs import GreedyProbsCalculator
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from halwatch.detectors.polygraph import ESTIMATORS
    from halwatch.models import registry

    folder = registry.model_dir(registry.DEFAULT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    model = WhiteboxModel(hf, tokenizer, model_path=str(folder))
    calculators = (EntropyCalculator(), AttentionForwardPassCalculator(), AttentionElicitingPromptCalculator())
    with torch.inference_mode():
        for line in open(answers, encoding="utf-8"):
            record = json.loads(line)
            new_tokens = len(tokenizer(record["response"], add_special_tokens=False)["input_ids"])
            stats = GreedyProbsCalculator(output_attentions=True)({}, [record["prompt"]], model,
                                                                  max_new_tokens=new_tokens)
            for calc in calculators:
                stats.update(calc(stats, [record["prompt"]], model))
            stats["model"] = model
            scores = {name: float(getattr(estimators, name)()(stats)[0]) for name in ESTIMATORS}
            print(json.dumps({"id": record["id"], **scores}), flush=True)


if __name__ == "__main__":
    polygraph_process(Path(sys.argv[1]))
