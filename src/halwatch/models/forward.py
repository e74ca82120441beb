"""One teacher-forced forward pass over ``prompt + response`` that returns only the signals asked for.

Attention maps are never materialised for every layer: the model runs with PyTorch's fused SDPA attention, and a thin
attention function registered with transformers (``halwatch``) recomputes, for the requested ``(layer, head)`` pairs
only, the softmax rows from the query and key states that the layer already computed (after rotary embedding, with
the layer's own mask and scaling). The per-head reducers (:mod:`halwatch.signals.reducers`: lookback ratios,
MTop-Div, the diagonal, the sink) run on those rows inside the pass, layer by layer, in torch on the model's device;
only their small per-head results leave it.
"""

from __future__ import annotations

import contextlib

import numpy as np

from halwatch.errors import ModelError, first_line
from halwatch.models import adapter as adapter_lib
from halwatch.models import relevance as lrp
from halwatch.models.capture import ACTIVE, Capture, capturing
from halwatch.models.masking import explicit_attention
from halwatch.models.signal_types import SignalRequest, Signals
from halwatch.models.transfer import to_host
from halwatch.signals import stats_kernel, support
from halwatch.signals.reducers import on_device
from halwatch.timing import timed
from halwatch.tokens import TokenView, tail_start

ATTN_IMPLEMENTATION = "halwatch"
def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA attention (explicit products while relevance is propagated, or where the logits are soft-capped), plus
    capture of the requested heads' rows when a capture is active."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    softcap = kwargs.pop("softcap", None)
    capture = ACTIVE.get()
    if capture is not None:
        capture.record(module, query.detach(), key.detach(), attention_mask, scaling, softcap)
    kept = adapter_lib.KEEP.get()
    if kept is not None:
        kept.record(module, key, value)
    if lrp.active() is not None:
        if softcap:
            raise ModelError(f"{type(module).__name__}: relevance propagation through soft-capped attention logits "
                             f"(Gemma 2) is not implemented; the other detectors work with this model")
        return lrp.attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                             **kwargs), None
    if softcap:
        return explicit_attention(query, key, value, attention_mask, scaling, softcap), None  # SDPA cannot cap
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def architecture(model) -> str:
    return f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r})"


def install(model) -> None:
    """Switch ``model`` to the capturing attention (numerically the same as SDPA when nothing is captured), or
    refuse an architecture that does not run its attention through transformers' attention interface."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, sdpa_mask)
    if not getattr(model, "_supports_attention_backend", False):
        raise ModelError(f"{architecture(model)}: halwatch cannot capture this architecture's attention (it does not "
                         f"run attention through transformers' attention interface){_OTHERS}")
    before = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        check_capture(model)
    except ModelError:  # refused: the model keeps its own attention, so no later pass captures unchecked rows
        model.set_attn_implementation(before or "sdpa")
        raise


_OTHERS = (", so detectors that read attention or relevance cannot use it; those that read token statistics or hidden "
           "states (perplexity, entropy, linear-probe, length) can")
#: The length of the input on which the capture is checked against the model's own eager attention.
CHECK_TOKENS = 24


def check_capture(model) -> None:
    """Once per model: the rows the capture computes for every head, on a short input, equal the attention maps of
    the model's own eager attention (transformers' ``output_attentions``), within 1e-4 (0.1 for 16-bit weights).
    An architecture whose attention the capture does not reproduce (a bidirectional encoder, attention sinks, a
    layout the capture does not know), or that cannot be checked, is refused here in one line naming it, rather
    than scored with wrong maps. The verdict is kept on the model."""
    verdict = getattr(model, "_halwatch_capture_check", None)
    if verdict is None:
        try:
            verdict = _capture_mismatch(model)
        except ModelError as exc:
            verdict = str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure of the check refuses the architecture, by name
            verdict = (f"{architecture(model)}: halwatch cannot check its capture of this architecture's attention "
                       f"against the model's eager attention ({first_line(exc, 200)}){_OTHERS}")
        model._halwatch_capture_check = verdict or ""
    if verdict:
        raise ModelError(verdict)


def _capture_mismatch(model) -> str | None:
    """The refusal when the captured rows differ from eager attention maps on a short input, else ``None``."""
    import torch

    config = model.config.get_text_config()
    vocab = model.get_input_embeddings().num_embeddings
    ids = [(7 + 31 * i) % vocab for i in range(CHECK_TOKENS)]
    heads = tuple((layer, head) for layer in range(config.num_hidden_layers)
                  for head in range(config.num_attention_heads))
    view = TokenView(sample=None, input_ids=ids, n_prompt=CHECK_TOKENS // 2, offsets=[], input_mode="raw")
    capture = Capture(SignalRequest(heads=heads, attention_from="all", keep_attention=True), [view])
    weight = next(model.parameters())
    device = weight.device
    with torch.inference_mode():
        with capturing(capture):
            model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
        _check_seen(capture, model)
        rows = capture.assemble()[0][0]
        model.set_attn_implementation("eager")
        try:
            maps = model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1,
                         output_attentions=True).attentions
        finally:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if not maps or any(maps[layer] is None for layer, _ in heads):
        return (f"{architecture(model)}: halwatch cannot check its capture of this architecture's attention (the "
                f"model returns no eager attention maps){_OTHERS}")
    # 16-bit eager attention rounds its scores to 8 or 11 bits (0.011 seen on SmolLM2 in bfloat16); what the check is
    # for differs by far more (0.38 to 0.96: a bidirectional encoder, attention sinks), and subtler differences
    # show in float32, where the survey and the tests run
    tolerance = 0.1 if weight.dtype in (torch.float16, torch.bfloat16) else 1e-4
    for k, (layer, head) in enumerate(heads):
        diff = float(np.abs(rows[k] - maps[layer][0, head].float().cpu().numpy()).max())
        if not diff <= tolerance:
            return (f"{architecture(model)}: halwatch's capture differs from this architecture's own eager attention "
                    f"(by {diff:.3g} at layer {layer}, head {head}){_OTHERS}")
    return None


def _check_seen(capture: Capture, model) -> None:
    """Refuse an architecture whose attention modules did not all reach the capture."""
    if capture.seen != set(capture.by_layer):
        missing = sorted(set(capture.by_layer) - capture.seen)
        raise ModelError(f"{architecture(model)}: the attention of layer(s) {missing} was not captured (its "
                         f"attention modules do not name their layer): halwatch cannot read this architecture's "
                         f"attention")


def check_adapter(model) -> None:
    """Once per model: the adapter's layers, run with their updates at zero, give the pass's own states
    (:func:`halwatch.models.adapter.check`); the verdict is kept on the model."""
    verdict = getattr(model, "_halwatch_adapter_check", None)
    if verdict is None:
        try:
            adapter_lib.check(model)
            verdict = ""
        except ModelError as exc:
            verdict = str(exc)
        model._halwatch_adapter_check = verdict
    if verdict:
        raise ModelError(verdict)


def crop_cache(cache, length: int) -> None:
    """Cut a key/value cache back to its first ``length`` tokens."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def padded(views: list[TokenView], pad: int, offset: int = 0):
    """``(input ids, attention mask)`` of ``views`` as one right-padded batch: the ids from position ``offset`` on
    (the positions before it are in a cache), the mask over every position."""
    import torch

    longest = max(len(v.input_ids) for v in views)
    ids = torch.full((len(views), longest - offset), pad, dtype=torch.long)
    mask = torch.zeros((len(views), longest), dtype=torch.long)
    for b, v in enumerate(views):
        ids[b, : len(v.input_ids) - offset] = torch.tensor(v.input_ids[offset:])
        mask[b, : len(v.input_ids)] = 1
    return ids, mask


def ensure_installed(model) -> None:
    """:func:`install` unless the model already runs halwatch's attention."""
    if getattr(model.config, "_attn_implementation", None) != ATTN_IMPLEMENTATION:
        install(model)


def _prepare(model, views: list[TokenView], request: SignalRequest, cache, offset: int) -> None:
    """Before a pass: the capturing attention installed where the request reads attention, relevance or the
    adapter (plain passes run in the model's own attention), the adapter checked, and a cached prefix refused where
    the request cannot use one."""
    if request.heads or request.relevance is not None or request.adapter:
        ensure_installed(model)
    if request.adapter is not None:
        check_adapter(model)
    if offset and request.adapter is not None:
        raise ValueError("the adapter needs the prompt's keys and values from the pass, not a cached prefix")
    if offset and (offset >= min(v.n_prompt for v in views) or request.attention_from == "all"):
        raise ValueError(f"a cached prefix of {offset} tokens leaves no room for the signals asked for")
    if request.relevance is not None and cache is not None:
        raise ValueError("relevance needs the whole input in the pass, not a cached prefix")


@timed("forward pass")
def run(scoring_model, views: list[TokenView], request: SignalRequest, past=None) -> list[Signals]:
    """Run one batch (right-padded) and return the requested signals of each sample.

    ``past``: ``(cache, P)``, a key/value cache of the first ``P`` input tokens, which every view shares, with one
    row per view (guided decoding scores its candidates this way); only the tokens after it are run. ``P`` must be
    below every view's ``n_prompt`` (signals begin at the last prompt token), and no cached prefix can serve
    ``attention_from="all"``. The cache is left with ``P`` tokens.
    """
    import torch

    model = scoring_model.model
    rel = request.relevance
    cache, offset = past if past is not None else (None, 0)
    _prepare(model, views, request, cache, offset)
    lengths = [len(v.input_ids) for v in views]
    longest = max(lengths)
    ids, mask = padded(views, scoring_model.tokenizer.pad_token_id or 0, offset)
    device = scoring_model.device
    ids, mask = ids.to(device), mask.to(device)
    # logits only where they are used: the positions that predict response tokens
    first_needed = min(v.n_prompt for v in views) - 1
    keep = longest - first_needed if request.token_stats or rel is not None else 1
    attn_mask = mask if len(views) > 1 or min(lengths) < longest else None
    capture = Capture(request, views, offset) if request.heads else None
    adapted = request.adapter.layers() if request.adapter is not None else ()
    with contextlib.ExitStack() as stack:
        if rel is None:
            stack.enter_context(torch.inference_mode())
            inputs = {"input_ids": ids}
        else:  # with gradients and the propagation rules, from the input embeddings on
            stack.enter_context(torch.enable_grad())
            stack.enter_context(lrp.rules(model, rel.method))
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
            inputs = {"inputs_embeds": embeds}
        try:
            with capturing(capture), adapter_lib.keeping(adapted) as kept:
                out = model(**inputs, attention_mask=attn_mask, past_key_values=cache,
                            output_hidden_states=bool(request.hidden_layers or request.token_hidden_layers
                                                      or adapted),
                            logits_to_keep=keep, use_cache=cache is not None)
        finally:
            if cache is not None:
                crop_cache(cache, offset)
        if capture is not None:
            _check_seen(capture, model)
        if rel is not None:
            values, index = lrp.targets(out.logits, views, longest - keep, rel.target)
            by_seed = lrp.backward_relevance(embeds, values, views, rel.rows)
            row_sums = lrp.prompt_row_sums(model, embeds, attn_mask, views, longest - keep, keep, index)
    if capture is not None:
        capture.finish()  # queued on the device before the host's own work below, which it overlaps
    # the lexical support is the host's work alone: done while the device finishes the batch
    supports = [support_of(v) if request.support and v.sample is not None else None for v in views]
    batch = batch_outputs(out, views, request, offset, longest - keep)
    captured = capture.assemble() if capture is not None else None
    adapter_logits = adapter_lib.token_logits(model, request.adapter, out.hidden_states[request.adapter.start].detach(),
                                              kept, views) if kept is not None else None
    results = []
    for b, v in enumerate(views):
        sig = Signals(n_prompt=v.n_prompt, n_response=v.n_response, heads=request.heads,
                      hidden_layers=request.hidden_layers, token_hidden_layers=request.token_hidden_layers,
                      **{name: per_sample[b] for name, per_sample in batch.items()})
        if capture is not None:
            sig.attention, sig.reduced, sig.evidence = captured[b]
        if adapter_logits is not None:
            sig.adapter = adapter_logits[b]
        if rel is not None:
            sig.relevance = {
                "mean": by_seed[b][0].astype(np.float32),
                "response": (row_sums[b] / v.n_prompt).astype(np.float32),
                "logits": values[b, : v.n_response].detach().float().cpu().numpy(),
            }
            if rel.rows:
                sig.relevance["rows"] = by_seed[b][1:, : v.n_prompt].astype(np.float32)
        if supports[b] is not None:  # views made from token ids alone have no texts to compare
            sig.support, sig.support_answer = supports[b]
        results.append(sig)
    return results


#: Response rows whose next-token distributions are normalised at a time on a GPU: bounds the float32 copy of the
#: logits (100 MB for a 49,152-token vocabulary).
LOGIT_ROWS = 512

#: On a CPU, the float32 logits normalised at a time: pieces that stay in the cache. For 220 response rows of a
#: 49,152-token vocabulary on a 2-core EPYC (1 MB L2 per core, 32 MB L3) the log-probabilities and entropies took
#: 48 ms in pieces of 512 rows (100 MB), 20 ms in pieces of 64 and 11 ms in pieces of 16 (3 MB), the same numbers.
CPU_LOGIT_BYTES = 4 << 20


def logit_rows(logits) -> int:
    """How many rows of ``logits`` (``[..., vocabulary]``) to normalise at a time on their device."""
    if logits.device.type != "cpu":
        return LOGIT_ROWS
    return max(1, CPU_LOGIT_BYTES // (4 * logits.shape[-1]))


def token_stats(logits, views: list[TokenView], first_logit: int, sample, position, target):
    """``(log-probabilities, entropies)`` of every response token of the batch, ``[sum R]`` float32 on the logits'
    device: token ``s`` is predicted by row ``position[s]`` of answer ``sample[s]`` of ``logits [B, P, V]`` (whose
    row 0 is absolute position ``first_logit``) and is ``target[s]``. On a GPU with Triton one launch reads each
    row once (:mod:`halwatch.signals.stats_kernel`); this loop is the reference, the CPU path and the fallback."""
    import torch

    done = stats_kernel.KERNEL.attempt(logits, stats_kernel.token_stats, logits, sample, position, target)
    if done is not None:
        return done
    logprobs, entropy = [], []
    done = 0  # response tokens of the samples before this one
    step = logit_rows(logits)
    for b, v in enumerate(views):  # each sample's rows are one slice of its logits: no copy of them
        rows = logits[b, v.n_prompt - 1 - first_logit : len(v.input_ids) - 1 - first_logit]
        for lo in range(0, len(rows), step):
            logp = torch.log_softmax(rows[lo:lo + step].float(), -1)
            logprobs.append(logp.gather(1, target[done + lo : done + lo + len(logp), None])[:, 0])
            entropy.append(-logp.exp().mul_(logp).sum(-1))  # p log p, in p's own memory
        done += v.n_response
    return torch.cat(logprobs), torch.cat(entropy)


@timed("token statistics, hidden states")
def batch_outputs(out, views: list[TokenView], request: SignalRequest, offset: int, first_logit: int) -> dict:
    """The token statistics and hidden states of every sample of the batch, computed for all of its response tokens
    at once and copied off the device once: ``{field: [value of sample b]}`` for the fields of :class:`Signals`
    (``logprobs``, ``entropy``, ``hidden``, ``token_hidden``) the request asks for. ``first_logit``: the absolute
    position of ``out.logits[:, 0]``; ``offset``: that of ``out.hidden_states[i][:, 0]``."""
    import torch

    if not (request.token_stats or request.hidden_layers or request.token_hidden_layers):
        return {}
    counts = [v.n_response for v in views]
    ends = np.cumsum(counts)[:-1]
    device = (out.logits if out.logits is not None else out.hidden_states[0]).device
    sample = on_device(np.repeat(np.arange(len(views)), counts), device)
    position = on_device([p for v in views for p in range(v.n_prompt, len(v.input_ids))], device)
    fields = {}
    if request.token_stats:
        target = on_device([t for v in views for t in v.input_ids[v.n_prompt:]], device)
        fields["logprobs"], fields["entropy"] = token_stats(out.logits.detach(), views, first_logit, sample,
                                                             position - 1 - first_logit, target)

    def response_hidden(i):  # [sum R, d]: every response token's hidden state after layer i
        return out.hidden_states[i][sample, position - offset].detach().float()

    if request.hidden_layers:
        rows = [response_hidden(i) for i in request.hidden_layers]
        if request.hidden_pool == "mean_last":
            size = on_device(counts, device, torch.float32)[:, None]
            last = on_device(np.cumsum(counts) - 1, device)
            rows = [torch.stack([torch.zeros(len(views), r.shape[1], device=device).index_add_(0, sample, r) / size,
                                 r[last]], dim=1) for r in rows]  # [B, 2, d] each
            fields["pooled"] = torch.stack(rows, dim=1)
        else:
            fields["hidden"] = torch.stack(rows, dim=1)  # [sum R, layers, d]
    if request.token_hidden_layers:
        fields["token_hidden"] = torch.stack([response_hidden(i).half() for i in request.token_hidden_layers], dim=1)
    fields = to_host(fields)
    out = {name: np.split(fields[name].astype(np.float32), ends)  # astype copies: no view of a page-locked buffer
           for name in ("logprobs", "entropy") if name in fields}
    out.update({name: [part.transpose(1, 0, 2).copy() for part in np.split(fields[name], ends)]
                for name in ("hidden", "token_hidden") if name in fields})
    if "pooled" in fields:
        out["hidden"] = [pooled.copy() for pooled in fields["pooled"]]
    return out



@timed("lexical support")
def support_of(view: TokenView):
    """``(per-token flags, answer features)``: the lexical support of ``view``'s response by its context
    (:mod:`halwatch.signals.support`), from the whole context, even where the token cap cut it from the model's
    input, up to its last :data:`~halwatch.signals.support.MAX_CONTEXT_CHARS` characters."""
    sample = view.sample
    context = sample.context_text
    context = context[tail_start(context, support.MAX_CONTEXT_CHARS):]
    return support.features(context, sample.response, view.offsets)


def attach_support(view: TokenView, sig: Signals) -> None:
    """Put :func:`support_of` ``view`` on ``sig``."""
    sig.support, sig.support_answer = support_of(view)


def whitebox_request(model) -> SignalRequest:
    """One forward pass that feeds every white-box detector and baseline: token statistics, pooled hidden states of
    the middle and last layer (linear probe), every response token's hidden state of the middle layer (token-level
    classifiers), and for every head the MTop-Div (TOHA), the lookback ratios (Lookback Lens) and the attention
    diagonal (LLM-Check); and the lexical support of the response by its context. Benchmarks always ask for exactly
    this, and the scorer serves any request it covers from its cached entries, so detectors, protocols and reruns
    share one pass per answer. The attention sink (:func:`halwatch.signals.reducers.sink`) is not in it: no detector
    reads it since its feature was dropped (a shortcut, :mod:`halwatch.detectors.fused`), and every cached answer
    kept it, one number per head and response token."""
    return SignalRequest(
        token_stats=True,
        hidden_layers=(model.n_layers // 2, model.n_layers),
        hidden_pool="mean_last",
        token_hidden_layers=(model.n_layers // 2,),
        heads=model.all_heads(),
        reducers=("diag", "lookback", "mtopdiv"),
        support=True,
    )
