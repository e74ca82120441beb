"""Phase 1 of the adapter dev check (issue 33's "scoring model's own top layers, fine-tuned with a token head"):
one frozen pass per RAGTruth train/dev answer up to layer START + DEPTH, keeping
- the response tokens' hidden state entering layer START (hidden_states[START]),
- per adapted layer START .. START + DEPTH - 1 the prompt tokens' keys (after rotary) and values,
- the response tokens' hidden state leaving the last adapted layer (to check the adapter's own forward).
Saved per split as one torch file. Usage: capture.py OUT.pt SPLIT [LIMIT] [DATASET] [MODE]  (DATASET: ragtruth:all; MODE: the input mode, raw or chat)"""

import sys
import time

import torch
from adapter import DEPTH, START, head_layout

from halwatch.data.splits import split_of
from halwatch.eval.datasets import load_dataset
from halwatch.models.loader import load_model
from halwatch.tokens import encode


class Stop(Exception):
    pass


def main(out, split, limit=None, dataset="ragtruth:all", mode="raw"):
    torch.set_num_threads(2)
    sm = load_model("smollm2-135m")
    model, tok = sm.model, sm.tokenizer
    model.eval()
    inner = model.model
    layers = inner.layers
    cfg = model.config
    samples = [s for s in load_dataset(dataset)[0] if split_of(s) == split]
    if limit:
        samples = samples[:limit]
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    got = {}

    def keep(name):
        def hook(_m, _i, output):
            got[name] = output[0] if isinstance(output, tuple) else output
        return hook

    def keep_in(name):
        def hook(_m, args, kwargs):
            got[name] = kwargs.get("hidden_states", args[0] if args else None)
        return hook

    handles = [layers[START].register_forward_pre_hook(keep_in("h_in"), with_kwargs=True)]
    for i in range(START, START + DEPTH):
        handles.append(layers[i].self_attn.k_proj.register_forward_hook(keep(f"k{i}")))
        handles.append(layers[i].self_attn.v_proj.register_forward_hook(keep(f"v{i}")))

    def stop(_m, _i, output):
        got["h_out"] = output[0] if isinstance(output, tuple) else output
        raise Stop

    handles.append(layers[START + DEPTH - 1].register_forward_hook(stop))
    _, kvh, hd = head_layout(cfg)
    records = []
    t0 = time.time()
    for n, s in enumerate(samples):
        view = encode(s, tok, mode)
        ids = torch.tensor([view.input_ids])
        p = view.n_prompt
        got.clear()
        with torch.inference_mode():
            try:
                model(input_ids=ids, use_cache=False)
            except Stop:
                pass
            pos = torch.arange(ids.shape[1])[None]
            cos, sin = inner.rotary_emb(got["h_in"], pos)
            keys, values = [], []
            for i in range(START, START + DEPTH):
                k = got[f"k{i}"][0].view(-1, kvh, hd).transpose(0, 1)[None]  # [1, kvh, T, hd]
                k, _ = apply_rotary_pos_emb(k, k, cos, sin)
                keys.append(k[0, :, :p].to(torch.float16))
                values.append(got[f"v{i}"][0].view(-1, kvh, hd).transpose(0, 1)[:, :p].to(torch.float16))
        records.append({"labels": torch.tensor(view.token_labels()), "use": view.has_token_labels,
                        "label": int(s.label), "source": s.source, "n_prompt": p,
                        "h_in": got["h_in"][0, p:].clone(), "h_out": got["h_out"][0, p:].clone(),
                        "k": torch.stack(keys), "v": torch.stack(values)})
        if n % 100 == 0:
            print(f"{n}/{len(samples)} {time.time() - t0:.0f}s", flush=True)
    torch.save({"records": records}, out)
    print("done", len(records), f"{time.time() - t0:.0f}s")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "all" else None,
         sys.argv[4] if len(sys.argv) > 4 else "ragtruth:all", sys.argv[5] if len(sys.argv) > 5 else "raw")
