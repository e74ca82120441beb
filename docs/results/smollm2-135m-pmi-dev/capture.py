"""Phase 1 of the conditional-PMI dev check (issue 36): for every dev answer of DATASET, the log-probability of
each response token in three plain forward passes of SmolLM2-135M (float32, the CPU): after the whole prompt
(``ctx``, the view the shipped detectors read), after the prompt less its context span (``noctx``: instruction and
question kept) and after the answer header alone (``hdr``; one prompt token where the prompt has no header); with
the answer's label, token labels (human spans) and source. Usage: capture.py DATASET OUT.npz"""
import sys
import time

import numpy as np
import torch

from halwatch.data.splits import split_of
from halwatch.eval.datasets import load_dataset
from halwatch.models.loader import load_model
from halwatch.tokens import encode

torch.set_num_threads(2)
sm = load_model("smollm2-135m")
model, tok = sm.model, sm.tokenizer
model.eval()


def logp(ids, n_prompt):
    """log p of each of ``ids[n_prompt:]`` given the tokens before it."""
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    tgt = torch.tensor(ids[n_prompt:])
    return out[n_prompt - 1:len(ids) - 1].gather(1, tgt[:, None])[:, 0].numpy()


def main(dataset, out):
    samples = [s for s in load_dataset(dataset)[0] if split_of(s) == "dev"]
    rows = {"ctx": [], "noctx": [], "hdr": [], "labels": [], "tok": [], "src": []}
    t0 = time.time()
    for k, s in enumerate(samples):
        v = encode(s, tok, "raw", 1024)
        resp = v.input_ids[v.n_prompt:]
        prompt = v.prompt_text()
        a, b = s.context_span or (0, 0)
        bare = prompt[:a] + prompt[b:]
        bare_ids = tok(bare, add_special_tokens=True)["input_ids"]
        hdr = v.input_ids[v.n_prompt - max(v.n_header, 1):v.n_prompt]
        rows["ctx"].append(logp(v.input_ids, v.n_prompt))
        rows["noctx"].append(logp(bare_ids + resp, len(bare_ids)))
        rows["hdr"].append(logp(hdr + resp, len(hdr)))
        rows["labels"].append(s.label)
        rows["tok"].append(v.token_labels())
        rows["src"].append(s.source)
        if k % 50 == 0:
            print(k, len(samples), f"{time.time() - t0:.0f}s", flush=True)
    np.savez(out, **{k: np.array(x, dtype=object) for k, x in rows.items()})


main(sys.argv[1], sys.argv[2])
