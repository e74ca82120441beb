"""Relevance of the input tokens for each response token (LRP4RAG section 3.2), by layer-wise relevance propagation
or Input x Gradient, computed inside the teacher-forced pass of :func:`halwatch.models.forward.run`.

Every rule is written as a modified gradient, so that the relevance of a tensor is ``input * modified gradient``
and one (batched) backward pass carries it from the explained logits to the input embeddings, where it is summed
over the embedding dimension. The rules (Achtibat et al. 2024, "AttnLRP", section 3):

- Linear layers (eq. 2, the epsilon rule with epsilon -> 0): the plain gradient. Residual additions split relevance
  in proportion to their inputs, which is again the plain gradient.
- Matrix multiplications of two activations, ``Q K^T`` and ``A V`` (eq. 1): AttnLRP's uniform rule, eq. 1 with a
  factor 1/2 on each operand, so that ``sum R_A + sum R_B = sum R_C`` (eq. 1 as printed counts the relevance twice).
  The same rule serves the gate x up product of gated MLPs.
- Softmax (the Jacobian rule of eq. 3-4): ``R_x = x * J^T (R_y / y)``, the plain gradient (AttnLRP Prop. 3.1).
- Normalisation (RMSNorm, LayerNorm) and element-wise activations (SiLU, GELU ...): the Jacobian rule with the
  Jacobian of the layer's own linearisation ``y = (y / x) * x`` (the identity rule of AttnLRP: the normaliser and
  the gate are held constant), which conserves relevance where eq. 3-4 with the full Jacobian would not.

``method="lrp-cp"`` holds the attention weights constant instead (the conservative propagation of Ali et al. 2022,
"CP-LRP"): relevance then flows through ``V`` only and is conserved from the explained logit down to the input
embeddings (up to rounding, in a model without biases). AttnLRP's softmax rule is not conservative: the part of the
relevance that passes through ``Q K^T`` is not preserved (in SmolLM2 about 60 % of the logit goes missing);
``halwatch bench relevance`` reports both. ``method="ixg"`` (Input x Gradient) uses the plain gradient everywhere.
The rules never divide by an output, so the stabiliser of the epsilon rule (1e-6 in the paper, section 4.2) is not
needed.

One backward pass per response token (the paper's way) is replaced by a batch of "seeds": the backward pass is
linear in the gradient that seeds it, so seeding it with a weighting ``s`` of the response positions returns
``s @ R*`` in one go. The seeds asked for are the mean over response tokens (``R^prompt``, eq. 5), the rows of the
eq. 7-9 resampling matrix (``R*`` resampled along the response) or the identity (``R*`` itself); they run as
vmapped (``is_grads_batched``) backward passes in chunks on an accelerator, one plain pass each on a CPU.
``R^response`` (eq. 6) is a sum over input tokens, a forward-mode derivative: one Jacobian-vector product with the
prompt's embeddings as tangent gives it for every response token.

The rules find their modules by kind: ``torch.nn.LayerNorm``, a class whose name ends in ``RMSNorm``, a gated MLP
with ``gate_proj``, ``up_proj`` and an ``act_fn`` module (``act_fn(gate_proj(x)) * up_proj(x)``, as in Llama), and
parameter-free activation modules. Everything else keeps its plain gradient, which is right for linear maps and
sums but not for normalisations, gated products or mixture-of-experts routing. Those the rules do not recognise (a
class with "norm" in its name that is none of the above; a module with a "gate" part that is not the Llama pattern,
such as Phi-3's fused ``gate_up_proj``; a mixture-of-experts block) are named in one warning per class, once per
model (:func:`unrecognised`): relevance through them is Input x Gradient's, not conserved. A Llama-pattern MLP
whose ``act_fn`` is not a module is refused: half of the uniform rule could be applied and not the other.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import weakref
from dataclasses import dataclass

import numpy as np

from halwatch.errors import HalwatchError

log = logging.getLogger("halwatch")

METHODS = ("lrp", "lrp-cp", "ixg")
TARGETS = ("token", "max")
#: How many seeds run in one batched backward pass (memory grows with it).
SEED_CHUNK = 16
#: Whether seeds run as vmapped batches: ``None`` = on an accelerator only (on a CPU a loop is faster).
BATCHED: bool | None = None

_RULES: contextvars.ContextVar = contextvars.ContextVar("halwatch_lrp", default=None)


#: Version of the relevance pass, part of the signal-cache key (2: ``R*`` rows resampled with exact integer bounds).
RELEVANCE_VERSION = 2


@dataclass(frozen=True)
class RelevanceRequest:
    """What relevance the pass computes.

    - ``method``: ``"lrp"`` (AttnLRP's rules above), ``"lrp-cp"`` (attention weights held constant) or ``"ixg"``
      (Input x Gradient).
    - ``target``: the logit explained at each response position: ``"token"``, the logit of the token the response has
      there (teacher forcing), or ``"max"``, the largest logit (the paper's choice).
    - ``rows``: besides ``R^prompt`` and ``R^response``, the matrix ``R*`` resampled to this many response rows
      (eq. 7-9, exact: each row is one seed); ``0`` for none, ``-1`` for ``R*`` itself (one seed per token).
    """

    method: str = "lrp"
    target: str = "token"
    rows: int = 0

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"relevance method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.target not in TARGETS:
            raise ValueError(f"relevance target must be one of {', '.join(TARGETS)}, not {self.target!r}")
        if self.rows < -1:
            raise ValueError(f"relevance rows must be -1 (all), 0 (none) or a count, not {self.rows}")


def scaled_gradient(x, factor: float):
    """Value ``x``, gradient multiplied by ``factor`` (a share of the uniform rule)."""
    return factor * x + (1.0 - factor) * x.detach()


def half(x):
    """Value ``x``, gradient halved (the uniform rule's share of one operand of a product)."""
    return scaled_gradient(x, 0.5)


def linearised(x, y):
    """Value ``y``, gradient as if ``y = (y / x) * x`` with ``y / x`` held constant (the identity rule)."""
    import torch

    xd, yd = x.detach(), y.detach()
    ratio = torch.where(xd.abs() > 1e-12, yd / torch.where(xd == 0, torch.ones_like(xd), xd), torch.zeros_like(xd))
    return yd + (x - xd) * ratio


def _layer_norm(module, x):
    """LayerNorm with the standard deviation held constant (mean removal stays linear and keeps its gradient)."""
    import torch

    centred = x - x.mean(-1, keepdim=True)
    scale = torch.rsqrt(centred.detach().pow(2).mean(-1, keepdim=True) + module.eps)
    out = centred * scale
    if module.weight is not None:
        out = out * module.weight
    if module.bias is not None:
        out = out + module.bias
    return out


_ACTIVATIONS = ("SiLU", "GELU", "ReLU", "Tanh", "Sigmoid", "Activation", "Mish", "Swish")
#: Models whose unrecognised modules were already reported (the warning comes once per model).
_WARNED: "weakref.WeakSet" = weakref.WeakSet()


def _is_norm(module) -> bool:
    """A normalisation the rules cover: ``torch.nn.LayerNorm`` or an RMSNorm (by class name)."""
    import torch

    return isinstance(module, torch.nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def _is_gated_mlp(module) -> bool:
    """The gated MLP the rules cover: ``act_fn(gate_proj(x)) * up_proj(x)`` (Llama, Mistral, Qwen, Gemma ...)."""
    return all(hasattr(module, a) for a in ("gate_proj", "up_proj", "act_fn"))


def _is_activation(module) -> bool:
    """A parameter-free element-wise activation module (by class name)."""
    kind = type(module).__name__
    return any(a in kind for a in _ACTIVATIONS) and not list(module.children())


def _uncovered(module) -> str | None:
    """Why relevance through ``module`` falls back to the plain gradient, or ``None`` when the rules cover it (or it
    needs no rule)."""
    kind = type(module).__name__.lower()
    if _is_norm(module) or _is_gated_mlp(module) or _is_activation(module):
        return None
    parts = [n for n, _ in module.named_children()] + [n for n, _ in module.named_parameters(recurse=False)]
    if "expert" in kind or any("expert" in n.lower() for n in parts):
        return ("a mixture-of-experts block: routing weights times expert outputs (and experts with a fused "
                "gate_up_proj) keep the plain gradient (no LRP rule for routing here)")
    gates = [n for n in parts if re.search(r"(^|_)gate", n)]
    if gates:
        return (f"a gated block (with {', '.join(gates)}) that is not act_fn(gate_proj(x)) * up_proj(x): its product "
                "keeps the plain gradient instead of the uniform rule (relevance counted on both factors)")
    if "norm" in kind and not any(_is_norm(m) for m in module.modules()):
        return ("a normalisation that is neither torch.nn.LayerNorm nor an RMSNorm: it keeps the plain gradient (the "
                "full Jacobian of eq. 3-4) instead of the identity rule")
    return None


def unrecognised(model) -> list[tuple[str, str, str]]:
    """``(path, class name, reason)`` of the outermost modules of ``model`` whose relevance the rules do not cover:
    norms, gated products and mixture-of-experts blocks they do not recognise (see the module docstring)."""
    found = []
    for path, module in model.named_modules():
        if any(p == "" or path.startswith(p + ".") for p, _, _ in found):
            continue
        reason = _uncovered(module)
        if reason is not None:
            found.append((path, type(module).__name__, reason))
    return found


def _warn_unrecognised(model, method: str) -> None:
    """One warning per class of unrecognised module, the first time ``model`` runs under the rules."""
    if model in _WARNED:
        return
    _WARNED.add(model)
    by_class: dict[str, list[tuple[str, str]]] = {}
    for path, kind, reason in unrecognised(model):
        by_class.setdefault(kind, []).append((path, reason))
    for kind, where in by_class.items():
        path, reason = where[0]
        more = f" (and {len(where) - 1} more like it)" if len(where) > 1 else ""
        log.warning("relevance (%s): %s at %s%s is %s; relevance through it is not conserved", method, kind,
                    path or "<model>", more, reason)


def _check_gated(path: str, module) -> None:
    """Refuse a gated MLP whose ``act_fn`` is a plain function: its ``up_proj`` would get the uniform rule's half
    and the gate path would not (the result would be neither LRP nor Input x Gradient)."""
    import torch

    if not isinstance(module.act_fn, torch.nn.Module):
        raise HalwatchError(f"relevance: {type(module).__name__} at {path or '<model>'} has gate_proj and up_proj but "
                            f"its act_fn is not a module ({type(module.act_fn).__name__}), so the LRP rules cannot "
                            f"hold the gate constant; use method=ixg for this model")


@contextlib.contextmanager
def rules(model, method: str):
    """Within the block, ``model`` propagates relevance by ``method``'s rules (a no-op for ``"ixg"`` except that
    attention runs as explicit, differentiable matrix products). Modules the rules do not recognise are reported in
    a warning, once per model; a gated MLP whose activation is not a module is refused (:class:`HalwatchError`)."""
    import torch

    handles = []
    token = _RULES.set(method)
    try:
        if method != "ixg":
            for path, module in model.named_modules():
                if _is_gated_mlp(module):
                    _check_gated(path, module)
            _warn_unrecognised(model, method)
            seen = set()

            def once(module, hook):
                if id(module) not in seen:
                    seen.add(id(module))
                    handles.append(module.register_forward_hook(hook))

            for module in model.modules():
                if isinstance(module, torch.nn.LayerNorm):
                    once(module, lambda m, args, out: _layer_norm(m, args[0]))
                elif _is_norm(module):
                    once(module, lambda m, args, out: linearised(args[0], out))
                elif _is_gated_mlp(module):
                    once(module.act_fn, lambda m, args, out: half(linearised(args[0], out)))
                    once(module.up_proj, lambda m, args, out: half(out))
                elif _is_activation(module):
                    once(module, lambda m, args, out: linearised(args[0], out))
        yield
    finally:
        _RULES.reset(token)
        for h in handles:
            h.remove()


def active() -> str | None:
    """The method whose rules are in force (``None`` outside :func:`rules`)."""
    return _RULES.get()


def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention under the rules, in the ``[batch, tokens, heads, dim]`` output layout of transformers' attention
    functions. Under LRP the uniform rule on ``A V`` halves the gradient to ``A`` and ``V``, and on ``Q K^T`` halves
    it again to ``Q`` and ``K``; each operand has one path to the output, so the rule is ``Q`` and ``K`` with a
    quarter of their gradient and ``V`` with half, through PyTorch's fused attention (softmax keeps its plain
    gradient). Under CP-LRP ``Q`` and ``K`` carry no gradient. In a forward-mode pass (no fused kernel supports it)
    the same function is spelt out as explicit products."""
    import torch.autograd.forward_ad as fwad
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    method = active()
    dual = any(fwad.unpack_dual(t).tangent is not None for t in (query, key, value))
    if method == "lrp":
        query, key, value = scaled_gradient(query, 0.25), scaled_gradient(key, 0.25), half(value)
    elif method == "lrp-cp":
        query, key = query.detach(), key.detach()
    if not dual:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0]
    from halwatch.models.masking import explicit_attention

    return explicit_attention(query, key, value, attention_mask, scaling)


def targets(logits, views, first: int, target: str):
    """The explained logit at every response position, ``[B, T]`` (zero-padded), and the vocabulary index of each."""
    import torch

    n_max = max(v.n_response for v in views)
    values = logits.new_zeros((len(views), n_max))
    index = torch.zeros((len(views), n_max), dtype=torch.long, device=logits.device)
    for b, v in enumerate(views):
        rows = logits[b, v.n_prompt - 1 - first : v.n_prompt - 1 - first + v.n_response]
        if target == "token":
            idx = torch.tensor(v.input_ids[v.n_prompt :], dtype=torch.long, device=logits.device)
        else:
            idx = rows.detach().argmax(-1)
        index[b, : v.n_response] = idx
        values[b, : v.n_response] = rows.gather(1, idx[:, None])[:, 0]
    return values, index


def seeds(n_response: int, rows: int) -> np.ndarray:
    """The seed weightings of one response, ``[1 + k, n_response]``: the mean (eq. 5), then the ``k`` rows of the
    eq. 7-9 resampling matrix (``rows > 0``), or one row per token (``rows == -1``)."""
    from halwatch.signals.relevance import resample_matrix

    mean = np.full((1, n_response), 1.0 / n_response)
    if rows == 0:
        return mean
    extra = np.eye(n_response) if rows == -1 else resample_matrix(n_response, rows)
    return np.concatenate([mean, extra])


def backward_relevance(embeds, values, views, rows: int, batched: bool | None = None) -> list[np.ndarray]:
    """``S @ R*`` over every input token for each view's seeds ``S`` (:func:`seeds`): ``[1 + k, n_input]`` each.

    ``batched``: run the seeds as vmapped backward passes of :data:`SEED_CHUNK`, or one plain backward pass each;
    default :data:`BATCHED`."""
    import torch

    per_view = [seeds(v.n_response, rows) for v in views]
    n_seeds = max(len(s) for s in per_view)
    grads_out = torch.zeros((n_seeds, *values.shape), dtype=values.dtype, device=values.device)
    for b, s in enumerate(per_view):
        grads_out[: len(s), b, : s.shape[1]] = torch.from_numpy(s).to(values.device, values.dtype)
    inputs = embeds.detach()
    # one vmapped backward pass per chunk of seeds on an accelerator; on a CPU a loop of plain passes is faster
    if batched is None:
        batched = BATCHED if BATCHED is not None else embeds.device.type != "cpu"
    chunk = SEED_CHUNK if batched else 1
    parts = []
    for start in range(0, n_seeds, chunk):
        seed = grads_out[start : start + chunk]
        last = start + chunk >= n_seeds
        if not batched:
            (grad,) = torch.autograd.grad(values, embeds, grad_outputs=seed[0], retain_graph=not last)
            grad = grad[None]
        else:
            (grad,) = torch.autograd.grad(values, embeds, grad_outputs=seed, is_grads_batched=True,
                                          retain_graph=not last)
        parts.append((grad * inputs).sum(-1).float())
    relevance = torch.cat(parts).cpu().numpy()  # [n_seeds, B, N]
    return [relevance[: len(s), b, : len(v.input_ids)] for b, (s, v) in enumerate(zip(per_view, views))]


def prompt_row_sums(model, embeds, mask, views, first: int, keep: int, index) -> list[np.ndarray]:
    """``sum_i R*[j, i]`` over the prompt tokens ``i`` for every response token ``j``: one forward-mode pass whose
    tangent is the prompt's input embeddings (each row of ``R*`` is a gradient dotted with the inputs)."""
    import torch
    import torch.autograd.forward_ad as fwad

    tangent = embeds.detach().clone()
    for b, v in enumerate(views):
        tangent[b, v.n_prompt :] = 0
    with torch.no_grad(), fwad.dual_level():
        out = model(inputs_embeds=fwad.make_dual(embeds.detach(), tangent), attention_mask=mask,
                    logits_to_keep=keep, use_cache=False)
        dlogits = fwad.unpack_dual(out.logits).tangent
        sums = []
        for b, v in enumerate(views):
            rows = dlogits[b, v.n_prompt - 1 - first : v.n_prompt - 1 - first + v.n_response]
            sums.append(rows.gather(1, index[b, : v.n_response, None])[:, 0].float().cpu().numpy())
    return sums
