"""The response-side adapter: layers START .. START + DEPTH - 1 of the frozen scoring model re-run for the response
tokens only, with low-rank updates (LoRA, Hu et al. 2021) on every projection, attending to the frozen pass's keys
and values of the prompt tokens; then an RMS norm and a linear token head (log-odds of "hallucinated")."""

import math

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The first adapted layer (0-based: its input is the middle layer's output) and how many are adapted.
START, DEPTH = 15, 6


def head_layout(config) -> tuple[int, int, int]:
    """``(query heads, key/value heads, head size)`` of a Llama-style config."""
    size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_attention_heads, config.num_key_value_heads, size


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + (x @ self.a.T @ self.b.T) * self.scale


class Adapter(nn.Module):
    def __init__(self, model, start: int = START, depth: int = DEPTH, rank: int = 8, alpha: float = 16.0):
        super().__init__()
        inner = model.model
        self.rotary = inner.rotary_emb
        self.start, self.depth = start, depth
        cfg = model.config
        self.nh, self.kvh, self.hd = head_layout(cfg)
        self.layers = [inner.layers[i] for i in range(start, start + depth)]
        for p in model.parameters():
            p.requires_grad_(False)
        self.loras = nn.ModuleDict()
        for j, layer in enumerate(self.layers):
            for name in PROJ:
                owner = layer.self_attn if name in PROJ[:4] else layer.mlp
                self.loras[f"{j}_{name}"] = LoRA(getattr(owner, name), rank, alpha) if rank else getattr(owner, name)
        self.norm_w = nn.Parameter(inner.norm.weight.detach().clone())
        self.eps = inner.norm.variance_epsilon
        self.head = nn.Linear(cfg.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def proj(self, j, name, x):
        return self.loras[f"{j}_{name}"](x)

    def hidden(self, h, k_prompt, v_prompt, n_prompt):
        """``h [R, d]`` entering layer ``start`` for the response tokens; ``k_prompt, v_prompt [depth, kvh, P, hd]``
        the frozen pass's (rotated) keys and values of the prompt. Returns ``[R, d]`` leaving the last layer."""
        r = h.shape[0]
        pos = torch.arange(n_prompt, n_prompt + r)[None]
        cos, sin = self.rotary(h[None], pos)
        mask = torch.ones(r, n_prompt + r, dtype=torch.bool).tril(n_prompt)
        x = h
        for j, layer in enumerate(self.layers):
            a = layer.input_layernorm(x)
            q = self.proj(j, "q_proj", a).view(r, self.nh, self.hd).transpose(0, 1)[None]
            k = self.proj(j, "k_proj", a).view(r, self.kvh, self.hd).transpose(0, 1)[None]
            v = self.proj(j, "v_proj", a).view(r, self.kvh, self.hd).transpose(0, 1)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys = torch.cat([k_prompt[j].to(x.dtype), k[0]], 1).repeat_interleave(self.nh // self.kvh, 0)
            vals = torch.cat([v_prompt[j].to(x.dtype), v], 1).repeat_interleave(self.nh // self.kvh, 0)
            att = F.scaled_dot_product_attention(q[0], keys, vals, attn_mask=mask)
            x = x + self.proj(j, "o_proj", att.transpose(0, 1).reshape(r, -1))
            m = layer.post_attention_layernorm(x)
            x = x + self.proj(j, "down_proj", F.silu(self.proj(j, "gate_proj", m)) * self.proj(j, "up_proj", m))
        return x

    def forward(self, h, k_prompt, v_prompt, n_prompt):
        x = self.hidden(h, k_prompt, v_prompt, n_prompt)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_w
        return self.head(x).squeeze(-1)


def check(records_file: str, count: int = 20) -> None:
    """With the updates at zero, the adapter must give the frozen model's own states leaving its last layer (the
    ``h_out`` that capture.py kept): prints the largest difference over the first ``count`` answers."""
    import sys

    from halwatch.models.loader import load_model

    sys.stdout.reconfigure(line_buffering=True)
    records = torch.load(records_file, weights_only=False)["records"][:count]
    adapter = Adapter(load_model("smollm2-135m").model)
    with torch.no_grad():
        worst = max(float((adapter.hidden(r["h_in"], r["k"], r["v"], r["n_prompt"]) - r["h_out"]).abs().max())
                    for r in records)
    scale = max(float(r["h_out"].abs().max()) for r in records)
    print(f"{len(records)} answers: largest difference {worst:.4f} on states up to {scale:.1f}")


if __name__ == "__main__":
    import sys

    check(sys.argv[1])
