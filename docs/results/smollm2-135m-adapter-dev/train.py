"""Phase 2: fit the response-side adapter (adapter.py) on RAGTruth train answers (80 % of the sources), choose the
span rule on the other 20 % (by source), read the dev split once.
Usage: train.py WORK [epochs] [rank] [lr] [DATASET FILE ...]
                                            (WORK: the folder holding capture.py's train.pt and dev.pt; each
                                            DATASET FILE pair adds that set's training answers, captured into
                                            WORK/FILE, to RAGTruth's, and its tag to the saved adapter's name)
       train.py WORK dev TAG [DATASET FILE] (the dev split with WORK/adapter-TAG.pt, e.g. TAG r8-e2; another
                                            dataset's dev answers captured into WORK/FILE)"""

import sys
import time

import numpy as np
import torch
from adapter import Adapter
from scipy.special import expit
from sklearn.metrics import average_precision_score, roc_auc_score
from torch.nn import functional as F

from halwatch.data.splits import split_of
from halwatch.detectors.spans import fit_span_rule, rule_spans
from halwatch.eval.datasets import load_dataset
from halwatch.eval.metrics import span_scores
from halwatch.models.loader import load_model
from halwatch.tokens import encode


def answer_probs(logits) -> list[float]:
    """Each answer's probability as the adapter's span gates read it: the sigmoid of its highest token log-odds."""
    return [float(expit(x.max())) if len(x) else 0.0 for x in logits]


def spans_of(views, logits, threshold, rule) -> list[list[dict]]:
    """Each answer's spans under the span rule (decision 0.5 on :func:`answer_probs`)."""
    return [rule_spans(v, x, p, 0.5, threshold, rule) for v, x, p in zip(views, logits, answer_probs(logits))]


def scores(ad, records):
    ad.eval()
    out = []
    with torch.no_grad():
        for r in records:
            out.append(ad(r["h_in"], r["k"], r["v"], r["n_prompt"]).numpy().astype(float))
    return out


def report(name, records, logits, views, threshold=None, rule=None):
    use = [i for i, r in enumerate(records) if r["use"]]
    y = np.concatenate([records[i]["labels"].numpy() for i in use])
    s = np.concatenate([logits[i] for i in use])
    labels = np.array([r["label"] for r in records])
    top = np.array([x.max() if len(x) else -9.0 for x in logits])
    row = {"set": name, "answers": len(records), "token_auroc": round(roc_auc_score(y, s), 4),
           "token_ap": round(average_precision_score(y, s), 4), "answer_auroc_max": round(roc_auc_score(labels, top), 4)}
    if threshold is not None:
        pred = spans_of(views, logits, threshold, rule)
        row |= {k: round(v, 4) for k, v in span_scores(pred, [v.sample.spans for v in views]).items()}
        grounded = [i for i, r in enumerate(records) if r["label"] == 0]
        row["grounded_without_span"] = round(float(np.mean([not pred[i] for i in grounded])), 4)
    print(row, flush=True)
    return row


def main(work, epochs=2, rank=8, lr=5e-4, extra=()):
    work = work.rstrip("/") + "/"
    torch.manual_seed(0)
    torch.set_num_threads(2)
    sm = load_model("smollm2-135m")
    train, train_samples = [], []
    for dataset, file in [("ragtruth:all", "train.pt"), *extra]:
        records = torch.load(work + file, weights_only=False)["records"]
        samples = [s for s in load_dataset(dataset)[0] if split_of(s) == "train"]
        assert len(samples) == len(records)
        train += records
        train_samples += samples
    sources = sorted({r["source"] for r in train})
    rng = np.random.default_rng(0)
    rng.shuffle(sources)
    held = set(sources[: len(sources) // 5])
    fit = [i for i, r in enumerate(train) if r["source"] not in held and r["use"]]
    probe = [i for i, r in enumerate(train) if r["source"] in held]
    print(f"fit {len(fit)} answers, probe {len(probe)} ({len(held)} of {len(sources)} sources)", flush=True)
    ad = Adapter(sm.model, rank=rank)
    params = [p for p in ad.parameters() if p.requires_grad]
    print("trainable", sum(p.numel() for p in params))
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    accum = 8
    steps = epochs * len(fit) // accum
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps + 1, pct_start=0.1)
    t0 = time.time()
    for epoch in range(epochs):
        ad.train()
        order = np.random.default_rng(epoch).permutation(fit)
        total = 0.0
        for n, i in enumerate(order):
            r = train[i]
            logits = ad(r["h_in"], r["k"], r["v"], r["n_prompt"])
            loss = F.binary_cross_entropy_with_logits(logits, r["labels"].float())
            (loss / accum).backward()
            total += float(loss)
            if (n + 1) % accum == 0:
                opt.step()
                sched.step()
                opt.zero_grad()
            if n % 200 == 0:
                print(f"epoch {epoch} {n}/{len(order)} loss {total / (n + 1):.4f} {time.time() - t0:.0f}s", flush=True)
        probe_logits = scores(ad, [train[i] for i in probe])
        report(f"probe epoch {epoch}", [train[i] for i in probe], probe_logits, None)
    # the span rule, on the probe
    tok = sm.tokenizer
    probe_views = [encode(train_samples[i], tok, "raw") for i in probe]
    threshold, rule, fitted = fit_span_rule(probe_logits, probe_views, np.array(answer_probs(probe_logits)), 0.5)
    print("rule", threshold, rule, fitted, flush=True)
    report("probe", [train[i] for i in probe], probe_logits, probe_views, threshold, rule)
    state = {k: v for k, v in ad.state_dict().items() if k.startswith(("loras", "norm", "head")) and ".base." not in k}
    torch.save({"state": state, "threshold": threshold, "rule": rule, "rank": rank},
               work + f"adapter-r{rank}-e{epochs}{''.join('-' + d for d, _ in extra)}.pt")


def read_dev(work, tag, dataset="ragtruth:all", file="dev.pt"):
    """The dev split, read once with the adapter and span rule saved as ``adapter-TAG.pt``."""
    work = work.rstrip("/") + "/"
    torch.set_num_threads(2)
    sm = load_model("smollm2-135m")
    saved = torch.load(work + f"adapter-{tag}.pt", weights_only=False)
    ad = Adapter(sm.model, rank=saved["rank"])
    ad.load_state_dict(saved["state"], strict=False)
    dev = torch.load(work + file, weights_only=False)["records"]
    dev_samples = [s for s in load_dataset(dataset)[0] if split_of(s) == "dev"]
    assert len(dev_samples) == len(dev)
    dev_views = [encode(s, sm.tokenizer, "raw") for s in dev_samples]
    dev_logits = scores(ad, dev)
    report(f"dev {dataset}", dev, dev_logits, dev_views, saved["threshold"], saved["rule"])
    np.save(work + f"dev-{tag}-{file.removesuffix('.pt')}.npy", np.array([x.max() for x in dev_logits]))
    np.save(work + f"dev-{tag}-{file.removesuffix('.pt')}-tokens.npy", np.array(dev_logits, dtype=object),
            allow_pickle=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) > 1 and args[1] == "dev":
        read_dev(args[0], args[2], *args[3:5])
    else:
        main(args[0], int(args[1]) if len(args) > 1 else 2, int(args[2]) if len(args) > 2 else 8,
             float(args[3]) if len(args) > 3 else 5e-4, list(zip(args[4::2], args[5::2])))
