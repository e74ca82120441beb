"""Score RAGTruth QA's official test split with the trained LettuceDetect peer (issue 75) and print its metrics.

Run with the LettuceDetect venv:

    /work/ldvenv/bin/python evaluate.py --model OUT_DIR/best --data DATA_DIR [--predictions PATH] [--limit N]

DATA_DIR/test.json is written by export.py. Every answer goes through LettuceDetect's own inference,
``HallucinationDetector(method="transformer", max_length=512).predict_prompt(prompt, answer)`` (the path of its
``scripts/evaluate.py``: the RAGTruth prompt and the answer as one pair, the prompt truncated to fit), once with
``output_format="tokens"`` (per answer token: the argmax ``pred`` and the hallucinated-class ``prob``) and once with
``output_format="spans"`` (runs of predicted tokens as character spans of the answer). Printed as JSON:

* ``answer_auroc``: answers ranked by their highest token hallucination probability (the answer's tokens; the
  trailing [SEP] that LettuceDetect's token output also carries is left out; ``answer_auroc_with_sep`` keeps it).
* ``response_precision/recall/f1``: LettuceDetect's own answer decision, an answer is hallucinated when it has a
  predicted span (any answer token predicted hallucinated), against the gold label (any gold span).
* ``span_precision/recall/f1``: character level, the set of characters inside predicted spans against the set inside
  gold spans, counts pooled over all answers (micro), as halwatch's ``span_scores``.
* ``seconds_per_answer_median/mean``: wall time of the ``tokens`` call (one forward pass plus LettuceDetect's
  pre- and post-processing) per answer on the CPU with ``--threads`` torch threads; the first answer is run
  repeatedly for ``--warmup-seconds`` (15) before timing. Read the times only from a run on an idle CPU.
  ``spans_call_seconds_*`` time the second (``spans``) call the same way.

``--lettuce-evaluator`` also runs LettuceDetect's own ``evaluate_detector_example_level`` and
``evaluate_detector_char_level`` on the same answers (two more passes) as a cross-check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from sklearn.metrics import precision_recall_fscore_support, roc_auc_score  # noqa: E402

from lettucedetect.datasets.hallucination_dataset import HallucinationData  # noqa: E402
from lettucedetect.models.inference import HallucinationDetector  # noqa: E402


def char_set(spans) -> set[int]:
    return {c for s in spans for c in range(int(s["start"]), int(s["end"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="trained model folder (train.py's OUTPUT_DIR/best)")
    parser.add_argument("--data", required=True, type=Path, help="folder with test.json (export.py)")
    parser.add_argument("--split", default="test", choices=("test", "dev"))
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--limit", type=int, default=None, help="first N answers only (smoke tests)")
    parser.add_argument("--warmup-seconds", type=float, default=15.0,
                        help="run the first answer repeatedly for this long before timing (at least once)")
    parser.add_argument("--predictions", type=Path, default=None, help="write one JSON line per answer here")
    parser.add_argument("--lettuce-evaluator", action="store_true",
                        help="also run LettuceDetect's evaluate_detector_example_level / _char_level")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    samples = HallucinationData.from_json(json.loads((args.data / f"{args.split}.json").read_text())).samples
    samples = samples[: args.limit] if args.limit else samples
    detector = HallucinationDetector(method="transformer", model_path=args.model, max_length=args.max_length,
                                     device=torch.device(args.device))
    special = set(detector.detector.tokenizer.all_special_tokens)

    # warm-up, untimed: the first answer is run repeatedly for --warmup-seconds before any answer is timed. The
    # times mean something only on an otherwise idle CPU: in the smoke test, with other jobs on the 2 cores, one
    # answer took 0.3 s or 0.95 s depending on the moment, whatever the input
    warm_start, warm_calls = time.perf_counter(), 0
    while warm_calls == 0 or time.perf_counter() - warm_start < args.warmup_seconds:
        detector.predict_prompt(samples[0].prompt, samples[0].answer, output_format="tokens")
        warm_calls += 1
    print(f"warm-up: {warm_calls} calls in {time.perf_counter() - warm_start:.1f} s", file=sys.stderr, flush=True)
    rows, token_s, span_s = [], [], []
    for i, s in enumerate(samples):
        t0 = time.perf_counter()
        tokens = detector.predict_prompt(s.prompt, s.answer, output_format="tokens")
        t1 = time.perf_counter()
        spans = detector.predict_prompt(s.prompt, s.answer, output_format="spans")
        t2 = time.perf_counter()
        token_s.append(t1 - t0)
        span_s.append(t2 - t1)
        answer_tokens = [t for t in tokens if t["token"] not in special]
        rows.append({
            "id": s.metadata.get("id"), "label": int(bool(s.labels)),
            "score": max((t["prob"] for t in answer_tokens), default=0.0),
            "score_with_sep": max((t["prob"] for t in tokens), default=0.0),
            "pred": int(bool(spans)),
            "pred_any_token": int(any(t["pred"] == 1 for t in answer_tokens)),
            "spans": [{"start": int(p["start"]), "end": int(p["end"])} for p in spans],
            "gold_spans": [{"start": g["start"], "end": g["end"]} for g in s.labels],
            "n_answer_tokens": len(answer_tokens), "seconds": t1 - t0, "spans_call_seconds": t2 - t1,
        })
        if (i + 1) % 50 == 0 or i + 1 == len(samples):
            print(f"[{i + 1}/{len(samples)}] median {statistics.median(token_s):.3f} s/answer", file=sys.stderr,
                  flush=True)

    labels = [r["label"] for r in rows]
    preds = [r["pred"] for r in rows]
    both = len(set(labels)) == 2
    p, r, f, _ = precision_recall_fscore_support(labels, preds, labels=[1], average=None, zero_division=0)
    tp = n_pred = n_gold = 0
    for row in rows:
        pc, gc = char_set(row["spans"]), char_set(row["gold_spans"])
        tp, n_pred, n_gold = tp + len(pc & gc), n_pred + len(pc), n_gold + len(gc)
    sp = tp / n_pred if n_pred else 0.0
    sr = tp / n_gold if n_gold else 0.0
    result = {
        "detector": "LettuceDetect 0.2.3 token classifier, all-MiniLM-L6-v2, trained on halwatch ragtruth:all train",
        "model": args.model, "split": args.split, "max_length": args.max_length, "threads": args.threads,
        "n": len(rows), "n_hallucinated": sum(labels),
        "answer_auroc": float(roc_auc_score(labels, [x["score"] for x in rows])) if both else float("nan"),
        "answer_auroc_with_sep": (float(roc_auc_score(labels, [x["score_with_sep"] for x in rows]))
                                  if both else float("nan")),
        "response_precision": float(p[0]), "response_recall": float(r[0]), "response_f1": float(f[0]),
        "n_predicted_hallucinated": sum(preds),
        "decision_disagreements_span_vs_any_token": sum(x["pred"] != x["pred_any_token"] for x in rows),
        "span_precision": sp, "span_recall": sr, "span_f1": 2 * sp * sr / (sp + sr) if tp else 0.0,
        "seconds_per_answer_median": statistics.median(token_s), "seconds_per_answer_mean": statistics.mean(token_s),
        "spans_call_seconds_median": statistics.median(span_s), "spans_call_seconds_mean": statistics.mean(span_s),
        "warmup_seconds": args.warmup_seconds, "torch": torch.__version__, "device": args.device,
    }
    if args.lettuce_evaluator:
        from lettucedetect.models.evaluator import evaluate_detector_char_level, evaluate_detector_example_level

        ex = evaluate_detector_example_level(detector, samples, verbose=False)
        result["lettuce_example_level_hallucinated"] = ex["hallucinated"]
        result["lettuce_char_level"] = evaluate_detector_char_level(detector, samples)
    if args.predictions:
        args.predictions.parent.mkdir(parents=True, exist_ok=True)
        args.predictions.write_text("".join(json.dumps(x) + "\n" for x in rows))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
