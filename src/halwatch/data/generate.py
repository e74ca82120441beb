"""Same-model data (the papers' main setting): the scoring model answers SQuAD 2.0 questions from their context with
the prompt of TOHA Table 15, and its answers are labelled with TOHA Appendix D.1 without the LLM judge:

- answerable question: ROUGE-L = 1 with a gold answer, or a gold answer inside the response -> grounded (0);
  ROUGE-L <= 0.3 with every gold answer and no gold answer inside -> hallucinated (1); otherwise dropped;
- unanswerable question: the refusal phrase in the response -> grounded (0); any other answer -> hallucinated (1).

The output is generic JSONL (``context``, ``question``, ``response``, ``label``, ``meta`` with the rule and the
ROUGE-L), appended one answer at a time, so an interrupted run resumes where it stopped. Dropped answers go to
``OUTPUT.dropped.jsonl`` beside it (kept for resuming and for counting).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from halwatch.progress import progress as progress_bar

REFUSAL = "Unable to answer based on given context"
LABEL_RULE = ("TOHA App. D.1 without the LLM judge: answerable -> grounded if ROUGE-L = 1 or a gold answer is a "
              "substring, hallucinated if ROUGE-L <= 0.3 and no gold substring, else dropped; unanswerable -> "
              "grounded if the refusal phrase is given, else hallucinated")


def words(text: str) -> list[str]:
    """Lower-cased word tokens (runs of letters, digits and underscores)."""
    return re.findall(r"\w+", text.lower())


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 (Lin 2004) on lower-cased word tokens: longest common subsequence, precision and recall."""
    a, b = words(candidate), words(reference)
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


def label_answer(response: str, answers: list[str], is_impossible: bool) -> tuple[int | None, float]:
    """``(label, best ROUGE-L)``; label ``None`` means the answer is dropped (neither rule applies)."""
    if is_impossible:
        return (0 if REFUSAL.lower() in response.lower() else 1), 0.0
    best = max((rouge_l(response, a) for a in answers), default=0.0)
    inside = any(a.strip() and a.strip().lower() in response.lower() for a in answers)
    if best >= 1.0 - 1e-9 or inside:
        return 0, best
    if best <= 0.3:
        return 1, best
    return None, best


def generate_answer(scoring_model, prompt: str, input_mode: str, max_new_tokens: int = 64) -> str:
    """Greedy answer of the scoring model to ``prompt`` (chat template in ``chat`` mode); the first line only in
    ``raw`` mode, where a base model has no end-of-turn token."""
    import torch

    from halwatch.tokens import prompt_token_ids

    tok = scoring_model.tokenizer
    ids = prompt_token_ids(tok, prompt, input_mode)
    with torch.inference_mode():
        device = scoring_model.device
        out = scoring_model.model.generate(torch.tensor([ids], device=device),
                                           attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                           max_new_tokens=max_new_tokens, do_sample=False,
                                           pad_token_id=tok.pad_token_id or tok.eos_token_id)
    text = tok.decode(out[0, len(ids):], skip_special_tokens=True).strip()
    return text.split("\n")[0].strip() if input_mode == "raw" else text


def _written(paths, key) -> dict:
    """Records already in the output files (for resuming), by ``key(record)``."""
    done = {}
    for path in paths:
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    done[key(record)] = record
    return done


def generate_squad(scorer, output: str | Path, n: int, seed: int = 0, titles=None, progress: bool = True) -> dict:
    """Answer ``n`` random SQuAD 2.0 questions with the scorer's model and label them; resumes from ``output``."""
    import random

    from halwatch.data.squad import read_squad

    questions = read_squad(titles=titles)
    order = random.Random(seed).sample(range(len(questions)), min(n, len(questions)))
    output = Path(output)
    dropped_path = output.with_name(output.name + ".dropped.jsonl")
    done = _written((output, dropped_path), lambda r: r["meta"]["question_id"])
    stats = {"answered": 0, "kept": 0, "dropped": 0, "hallucinated": 0}
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as kept, open(dropped_path, "a", encoding="utf-8") as dropped, \
            progress_bar(total=len(order), disable=not progress, desc="generate", unit="question") as bar:
        for i in order:
            q = questions[i]
            if q.id not in done:
                prompt = q.sample("-").prompt
                response = generate_answer(scorer.model, prompt, scorer.input_mode)
                label, score = label_answer(response, q.answers, q.is_impossible) if response else (None, 0.0)
                record = {"id": q.id, "context": q.context, "question": q.question, "response": response,
                          "label": label,
                          "meta": {"question_id": q.id, "title": q.title, "answers": q.answers,
                                   "is_impossible": q.is_impossible, "rouge_l": round(score, 4),
                                   "generator": scorer.model.name, "dtype": scorer.model.dtype,
                                   "input_mode": scorer.input_mode, "label_rule": LABEL_RULE}}
                target = kept if label is not None else dropped
                target.write(json.dumps(record, ensure_ascii=False) + "\n")
                target.flush()
                done[q.id] = record
            stats["answered"] += 1
            label = done[q.id]["label"]
            stats["kept" if label is not None else "dropped"] += 1
            stats["hallucinated"] += int(label == 1)
            bar.update(1)
    return stats


def generate_file(scorer, samples, output: str | Path, detector=None, options: dict | None = None,
                  progress: bool = True) -> dict:
    """Answer the prompt of every sample with the scorer's model (:func:`halwatch.models.guided.generate`,
    guided by ``detector`` or greedy), appending one record per answer to ``output`` (resumed by id). A sample
    whose ``meta`` has SQuAD's ``answers`` and ``is_impossible`` is labelled with the rule of this module (label
    ``null`` where the rule drops it). Returns counts and the mean seconds per answer."""
    from halwatch.models.guided import decoding_name, generate

    output = Path(output)
    done = _written((output,), lambda r: r["id"])
    stats = {"answered": 0, "labelled": 0, "hallucinated": 0, "seconds": 0.0}
    guide = decoding_name(detector, (options or {}).get("sample", False))
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "a", encoding="utf-8") as out, \
            progress_bar(total=len(samples), disable=not progress, desc=f"generate ({guide})", unit="answer") as bar:
        for s in samples:
            if s.id not in done:
                found = generate(scorer.model, s.prompt, scorer.input_mode, detector, max_tokens=scorer.max_tokens,
                                 where=s.where, **(options or {}))
                asked = {k: v for k, v in s.to_dict().items() if k in ("prompt", "context", "question")}
                record = {"id": s.id, **asked,
                          "response": found.text,
                          "meta": {**s.meta, "generator": scorer.model.name, "dtype": scorer.model.dtype,
                                   "input_mode": scorer.input_mode, "guide": guide, "options": options or {},
                                   "n_tokens": len(found.token_ids),
                                   "seconds": round(found.seconds, 3)}}
                if "answers" in s.meta and "is_impossible" in s.meta:
                    label, score = (label_answer(found.text, s.meta["answers"], s.meta["is_impossible"])
                                    if found.text else (None, 0.0))
                    record["label"] = label
                    record["meta"] |= {"rouge_l": round(score, 4), "label_rule": LABEL_RULE}
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                done[s.id] = record
            record = done[s.id]
            stats["answered"] += 1
            stats["labelled"] += int(record.get("label") is not None)
            stats["hallucinated"] += int(record.get("label") == 1)
            stats["seconds"] += record["meta"].get("seconds", 0.0)
            bar.update(1)
    stats["seconds_per_answer"] = stats.pop("seconds") / max(stats["answered"], 1)
    return stats
