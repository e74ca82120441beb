"""The scoring model's own upper layers, fine-tuned with a token head, read from the pass already run.

Layers ``start .. start + depth - 1`` of the frozen scoring model are run again for the response tokens only, with
low-rank updates on every linear map of those layers (LoRA, Hu et al. 2021, eq. 3: ``h = W0 x + (alpha / r) B A x``,
``B`` zero at the start so that training starts from the frozen model), attending to the keys and values that the
frozen pass computed for the prompt; the result goes through the model's final norm (its weight trained too) and a
linear token head whose output is each response token's log-odds of being hallucinated. Nothing below layer
``start`` runs twice: the input of layer ``start`` and the prompt's keys and values of the adapted layers are kept
while the one pass runs (:func:`keeping`), and the adapter runs after it (:func:`token_logits`).

The layers run through the model's own decoder-layer code (``torch.func.functional_call`` with the merged weights
``W0 + (alpha / r) B A``), so norms, rotary embeddings and attention are the architecture's own; the prompt's keys
and values come in through a stand-in for transformers' key/value cache (:class:`PromptCache`). An architecture
whose layers this does not reproduce is refused by :func:`check` (with the updates at zero the adapter must give
the pass's own hidden states), rather than trained on wrong states.

Departure from LoRA's paper: the updates sit on every projection of the adapted layers (the paper adapts the
attention's query and value maps), and a token-classification head is trained with them; the prompt's states are
the frozen model's, so only the response tokens see the adapted layers.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from halwatch.errors import ModelError

ADAPTER_VERSION = 1
#: Names of a decoder's final norm, by architecture family.
FINAL_NORMS = ("norm", "final_layer_norm", "ln_f")
KEEP: contextvars.ContextVar = contextvars.ContextVar("halwatch_adapter_keep", default=None)


def decoder(model):
    """The model's decoder stack (``layers``, a final norm, ``rotary_emb``), or a :class:`ModelError` naming what is
    missing."""
    inner = model.get_decoder() if hasattr(model, "get_decoder") else None
    missing = [name for name in ("layers", "rotary_emb") if not hasattr(inner, name)]
    if not any(hasattr(inner, name) for name in FINAL_NORMS):
        missing.append("final norm")
    if missing:
        raise ModelError(f"{type(model).__name__}: the adapter needs a decoder with {', '.join(missing)}; this "
                         f"architecture has none")
    return inner


def final_norm(inner):
    """The decoder's final norm module."""
    return next(getattr(inner, name) for name in FINAL_NORMS if hasattr(inner, name))


def sliding_window(model, index: int) -> int | None:
    """The sliding window of layer ``index``'s attention (``None``: it sees every earlier token): the attention
    module's own, else the config's layer types (Gemma, Qwen), else the config's one window for every layer
    (Mistral)."""
    attention = getattr(decoder(model).layers[index], "self_attn", None)
    if hasattr(attention, "sliding_window"):
        return attention.sliding_window or None
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None)
    if types is not None:
        return config.sliding_window if types[index] == "sliding_attention" else None
    return getattr(config, "sliding_window", None) or None


def rotary(model, x, position, index: int):
    """The rotary embeddings ``(cos, sin)`` of ``position`` for layer ``index``: the decoder's one rotary
    embedding, or the one of the layer's type where it has several (Gemma 3: sliding and full attention)."""
    import inspect

    embed = decoder(model).rotary_emb
    if "layer_type" in inspect.signature(embed.forward).parameters:
        return embed(x, position, layer_type=model.config.get_text_config().layer_types[index])
    return embed(x, position)


def projections(layer) -> list[str]:
    """The linear maps of a decoder layer (every ``nn.Linear`` in it: query, key, value, output, the MLP's), by
    name, in the layer's own order."""
    from torch import nn

    return [name for name, module in layer.named_modules() if isinstance(module, nn.Linear)]


def default_layers(n_layers: int) -> tuple[int, int]:
    """``(start, depth)``: the six layers above the middle one (15-20 of SmolLM2's 30, measured on RAGTruth's dev
    split: docs/results, smollm2-135m-adapter-dev), fewer where the model has fewer."""
    start = n_layers // 2
    return start, max(1, min(6, n_layers - start))


class PromptCache:
    """What an attention layer asks of transformers' key/value cache (``update``), serving the frozen pass's keys
    and values of the prompt (``[kv heads, P, head size]`` per layer) before the response tokens' own."""

    def __init__(self, keys: dict, values: dict):
        self.keys, self.values = keys, values

    def update(self, key, value, layer_idx, *_args, **_kwargs):
        import torch

        return (torch.cat([self.keys[layer_idx][None].to(key.dtype), key], dim=2),
                torch.cat([self.values[layer_idx][None].to(value.dtype), value], dim=2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(next(iter(self.keys.values())).shape[1])


def _module():
    import torch
    from torch import nn

    class Adapter(nn.Module):
        """The trainable part: LoRA factors ``a [rank, in]``, ``b [out, rank]`` for each projection of each adapted
        layer, the final norm's weight and the token head."""

        def __init__(self, model, start: int, depth: int, rank: int = 8, alpha: float = 16.0, seed: int = 0):
            super().__init__()
            inner = decoder(model)
            self.start, self.depth, self.rank, self.alpha = start, depth, rank, alpha
            self.scale = alpha / rank
            gen = torch.Generator().manual_seed(seed)
            self.a, self.b = nn.ParameterDict(), nn.ParameterDict()
            for j in range(depth):
                layer = inner.layers[start + j]
                for name in projections(layer):
                    base = layer.get_submodule(name)
                    key = f"{j}_{name.replace('.', '_')}"
                    self.a[key] = nn.Parameter(torch.randn(rank, base.in_features, generator=gen)
                                               / math.sqrt(base.in_features))
                    self.b[key] = nn.Parameter(torch.zeros(base.out_features, rank))
            self.norm = nn.Parameter(final_norm(inner).weight.detach().float().clone())
            self.head = nn.Linear(self.norm.shape[0], 1)
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

        def merged(self, model, j: int, dtype) -> dict:
            """Layer ``start + j``'s weights with the updates added, for ``functional_call``."""
            layer = decoder(model).layers[self.start + j]
            out = {}
            for name in projections(layer):
                key = f"{j}_{name.replace('.', '_')}"
                base = layer.get_submodule(name).weight
                out[f"{name}.weight"] = base + (self.scale * (self.b[key] @ self.a[key])).to(dtype)
            return out

        def hidden(self, model, h, keys: dict, values: dict, n_prompt: int, merged=None):
            """``h [R, d]`` entering layer ``start`` for the response tokens, the prompt's keys and values of the
            adapted layers (``{layer: [kv heads, P, head size]}``, keys after rotary as the pass computed them):
            the response tokens' states ``[R, d]`` leaving the last adapted layer."""
            from torch.func import functional_call

            inner = decoder(model)
            r = h.shape[0]
            position = torch.arange(n_prompt, n_prompt + r, device=h.device)[None]
            x = h[None]
            causal = torch.ones(r, n_prompt + r, dtype=torch.bool, device=h.device).tril(n_prompt)
            distance = position[0][:, None] - torch.arange(n_prompt + r, device=h.device)[None]  # query - key
            cache = PromptCache(keys, values)
            for j in range(self.depth):
                layer = inner.layers[self.start + j]
                window = sliding_window(model, self.start + j)
                embeddings = rotary(model, x, position, self.start + j)
                mask = (causal if window is None else causal & (distance < window))[None, None]
                weights = merged[j] if merged is not None else self.merged(model, j, x.dtype)
                out = functional_call(layer, weights, (x,), {
                    "attention_mask": mask, "position_ids": position, "past_key_values": cache,
                    "position_embeddings": embeddings, "use_cache": False})
                x = out[0] if isinstance(out, tuple) else out
            return x[0]

        def forward(self, model, h, keys, values, n_prompt, merged=None):
            """Each response token's log-odds of being hallucinated, ``[R]`` float32."""
            x = self.hidden(model, h, keys, values, n_prompt, merged)
            return self.head(normed(model, self.norm, x))[:, 0]

        def arrays(self) -> dict[str, np.ndarray]:
            """The trained tensors, float32, by name (what an artifact stores)."""
            return {k: v.detach().float().cpu().numpy() for k, v in self.state_dict().items()}

        def load_arrays(self, arrays: dict) -> None:
            self.load_state_dict({k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()})

    return Adapter


def normed(model, weight, x):
    """``x`` through the model's final norm with ``weight`` for its weight (the adapter's), in float32."""
    from torch.func import functional_call

    norm = final_norm(decoder(model))
    weights = {name: p.float() for name, p in norm.named_parameters()} | {"weight": weight}
    return functional_call(norm, weights, (x.float(),))


def new_adapter(model, start: int, depth: int, rank: int = 8, alpha: float = 16.0, seed: int = 0):
    """A fresh adapter of ``model`` (the updates at zero, so it gives the frozen model's states)."""
    return _module()(model, start, depth, rank, alpha, seed)


def digest(arrays: dict) -> str:
    """sha256 of an adapter's tensors (names, shapes and float32 values): its identity in caches."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        value = np.ascontiguousarray(np.asarray(arrays[name], dtype=np.float32))
        h.update(name.encode() + str(value.shape).encode() + value.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class AdapterRequest:
    """The adapter's token log-odds asked of the pass (``Signals.adapter``): identified by its tensors' digest and
    its layers; ``arrays`` (its tensors) and ``settings`` (rank, alpha) travel with it, outside its identity."""

    sha: str
    start: int
    depth: int
    arrays: dict = field(compare=False, hash=False, repr=False, default_factory=dict)
    settings: dict = field(compare=False, hash=False, repr=False, default_factory=dict)

    @classmethod
    def of(cls, arrays: dict, start: int, depth: int, rank: int, alpha: float) -> "AdapterRequest":
        return cls(digest(arrays), int(start), int(depth), arrays, {"rank": int(rank), "alpha": float(alpha)})

    def key(self) -> dict:
        return {"sha": self.sha, "start": self.start, "depth": self.depth, "version": ADAPTER_VERSION}

    def layers(self) -> range:
        return range(self.start, self.start + self.depth)


_LOADED: dict = {}  # (id(model), sha, dtype, device) -> (adapter, merged weights of each layer)


def loaded(model, request: AdapterRequest):
    """The request's adapter on ``model``'s device, with its merged layer weights in the model's dtype (made once
    per model, adapter and precision)."""
    import torch

    weight = next(model.parameters())
    key = (id(model), request.sha, weight.dtype, weight.device)
    if key not in _LOADED:
        adapter = new_adapter(model, request.start, request.depth, **request.settings)
        adapter.load_arrays(request.arrays)
        adapter.to(weight.device).eval()
        with torch.no_grad():
            merged = [{k: v.detach() for k, v in adapter.merged(model, j, weight.dtype).items()}
                      for j in range(request.depth)]
        _LOADED.clear()  # one adapter at a time: a refit's folds follow one another
        _LOADED[key] = (adapter, merged)
    return _LOADED[key]


class Kept:
    """The keys and values that the pass's attention layers computed, for the adapted layers only (``record`` is
    called by the attention function, :mod:`halwatch.models.forward`)."""

    def __init__(self, layers):
        self.layers = set(layers)
        self.kv: dict[int, tuple] = {}

    def record(self, module, key, value) -> None:
        layer = getattr(module, "layer_idx", None)
        if layer in self.layers:
            self.kv[layer] = (key.detach(), value.detach())

    def prompt(self, b: int, n_prompt: int) -> tuple[dict, dict]:
        """Sample ``b``'s prompt keys and values, ``{layer: [kv heads, P, head size]}`` each."""
        missing = self.layers - set(self.kv)
        if missing:
            raise ModelError(f"the attention of layer(s) {sorted(missing)} did not reach halwatch: this "
                             f"architecture cannot be adapted")
        return ({layer: k[b, :, :n_prompt] for layer, (k, _) in self.kv.items()},
                {layer: v[b, :, :n_prompt] for layer, (_, v) in self.kv.items()})


@contextlib.contextmanager
def keeping(layers):
    """Within the block, the attention function hands the keys and values of ``layers`` to the yielded
    :class:`Kept` (nothing is kept for an empty ``layers``)."""
    kept = Kept(layers) if layers else None
    token = KEEP.set(kept)
    try:
        yield kept
    finally:
        KEEP.reset(token)


def token_logits(model, request: AdapterRequest, hidden_in, kept: Kept, views) -> list[np.ndarray]:
    """Each view's adapter log-odds per response token (``[R]`` float32), from ``hidden_in`` (``[B, T, d]``, the
    pass's input to layer ``start``) and the kept prompt keys and values."""
    import torch

    adapter, merged = loaded(model, request)
    out = []
    with torch.inference_mode():
        for b, v in enumerate(views):
            keys, values = kept.prompt(b, v.n_prompt)
            h = hidden_in[b, v.n_prompt:len(v.input_ids)]
            out.append(adapter(model, h, keys, values, v.n_prompt, merged).float().cpu().numpy())
    return out


def check(model, tolerance: float | None = None) -> float:
    """The largest difference, on a short input, between a fresh adapter's states (updates at zero) and the pass's
    own hidden states leaving the last adapted layer; a :class:`ModelError` where it exceeds ``tolerance`` (1e-4 in
    float32, 0.1 in 16-bit weights) or the architecture cannot run the adapter."""
    import torch

    n_layers = model.config.get_text_config().num_hidden_layers
    start, depth = default_layers(n_layers)
    vocab = model.get_input_embeddings().num_embeddings
    # longer than a test model's sliding window (24 tokens), so that the window matters
    ids = torch.tensor([[(11 + 37 * i) % vocab for i in range(40)]], device=next(model.parameters()).device)
    n_prompt = 28
    adapter = new_adapter(model, start, depth).to(ids.device)
    try:
        with torch.inference_mode(), keeping(range(start, start + depth)) as kept:
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False, logits_to_keep=1)
            keys, values = kept.prompt(0, n_prompt)
            mine = adapter.hidden(model, out.hidden_states[start][0, n_prompt:], keys, values, n_prompt)
            if start + depth == n_layers:  # the last hidden state is given after the final norm
                mine = final_norm(decoder(model))(mine)
            theirs = out.hidden_states[start + depth][0, n_prompt:]
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure refuses the architecture, by name
        raise ModelError(f"{type(model).__name__}: halwatch cannot run the adapter on this architecture "
                         f"({exc})") from exc
    diff = float((mine.float() - theirs.float()).abs().max() / max(1.0, float(theirs.float().abs().max())))
    limit = tolerance if tolerance is not None else (0.1 if next(model.parameters()).element_size() == 2 else 1e-4)
    if not diff <= limit:
        raise ModelError(f"{type(model).__name__}: the adapter's states differ from the model's own by {diff:.3g} "
                         f"(relative): halwatch cannot adapt this architecture")
    return diff
