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
import contextvars
import threading

import numpy as np

from halwatch.errors import ModelError, first_line
from halwatch.models import relevance as lrp
from halwatch.models.masking import attention_probs, explicit_attention
from halwatch.models.signal_types import SignalRequest, Signals
from halwatch.signals import reducers as reducer_lib
from halwatch.signals import rows_kernel, stats_kernel, support
from halwatch.signals.reducers import REDUCERS, Rows, on_device
from halwatch.timing import timed
from halwatch.tokens import TokenView, tail_start

ATTN_IMPLEMENTATION = "halwatch"
#: Bytes of partial reducer results (e.g. MTop-Div's distances) held before they are finished together.
PARTIAL_BUDGET = 96 << 20
#: Samples of a batch whose attention rows the capture computes together on a CPU (``None``: the whole batch, as on
#: a GPU). One: on a CPU padding costs its arithmetic, and a batch of 32 RAGTruth answers took 1.5x the time.
CPU_GROUP: int | None = 1
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("halwatch_capture", default=None)


class _Group:
    """Samples of a batch whose rows the capture computes together: their layout (:class:`Rows`), the positions of
    their rows' queries, and what the reducers returned for them, layer by layer."""

    def __init__(self, index: list[int], views: list[TokenView], attention_from: str):
        self.index = index
        self.views = [views[b] for b in index]
        self.lengths = [len(v.input_ids) for v in self.views]
        first = [0 if attention_from == "all" else v.n_prompt - 1 for v in self.views]
        self.rows = Rows(tuple(v.n_prompt for v in self.views), tuple(v.n_header for v in self.views),
                         tuple(first), tuple(self.lengths), ids=tuple(v.input_ids for v in self.views))
        self.kept: dict[int, object] = {}  # layer -> the kept rows (keep_attention)
        self.reduced: dict[str, list] = {}  # per reducer: outputs of layers, in order, each field [B, H, ...]
        self.partial: dict[str, list] = {}  # per reducer with ``finish``: waiting partials
        self.positions = None

    def query_positions(self, device):
        """``[B, Q]``: the absolute position of each row's query (rows past a sample's last query repeat it)."""
        import torch

        if self.positions is None:
            span = max(n - s for n, s in zip(self.lengths, self.rows.row_start))
            start = on_device(self.rows.row_start, device)[:, None]
            last = on_device(self.lengths, device)[:, None] - 1
            self.positions = torch.minimum(start + torch.arange(span, device=device)[None, :], last)
        return self.positions


class _Capture:
    """Runs the requested reducers on the attention rows of the chosen heads while the model runs, layer by layer,
    in torch on the model's device; keeps the rows themselves only when asked (``keep_attention``). On a GPU the
    samples of the batch are computed all at once, with no loop over them until :meth:`assemble` hands out each
    sample's share of the results, which leave the device once per batch; on a CPU, where a launch costs nothing and
    padding costs its arithmetic (Prim's algorithm runs as many steps as the longest response), one sample at a
    time."""

    def __init__(self, request: SignalRequest, views: list[TokenView], offset: int = 0):
        self.request = request
        self.offset = offset  # absolute position of the first query run (the length of a cached prefix)
        self.by_layer: dict[int, list[int]] = {}
        for layer, head in request.heads:
            self.by_layer.setdefault(layer, []).append(head)
        self.views = views
        self.groups: list[_Group] | None = None  # made at the first layer, when the device is known
        self.seen: set[int] = set()  # layers whose rows were captured
        self.budget: int | None = None
        self.head_index: dict = {}  # (layer, device) -> the layer's requested heads, on the device (long)
        self.kernel_heads: dict = {}  # layer -> the same heads as the GPU kernel takes them (int32)
        self.plain_mask: dict = {}  # id(mask) -> (mask, whether it is the plain causal mask of the batch)
        self.layout = None  # the GPU kernel's n_prompt, context length and length, once per batch

    def _budget(self, tensor) -> int:
        """Bytes of partial reducer results held before they are finished together: :data:`PARTIAL_BUDGET` on a
        CPU; on a GPU an eighth of the memory this process could still take when the batch began (at least that),
        so that Prim's algorithm runs on many layers at once: the device's free memory, or less where the process
        is held to a share of it (:func:`halwatch.models.loader.share_device`; processes started together each see
        the whole device free, and a dozen of them ran it out of memory)."""
        if self.budget is None:
            import torch

            free = 0
            if tensor.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(tensor.device)
                share = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(tensor.device)
                free = min(free, int(share * total) - torch.cuda.memory_allocated(tensor.device))
            self.budget = max(PARTIAL_BUDGET, free // 8)  # Prim's join of the partials doubles them for a while
        return self.budget

    def record(self, module, query, key, attention_mask, scaling, softcap=None):
        import torch

        layer = getattr(module, "layer_idx", None)
        heads = self.by_layer.get(layer)
        if not heads:
            return
        self.seen.add(layer)
        if self.groups is None:
            size = CPU_GROUP if query.device.type == "cpu" and CPU_GROUP else len(self.views)
            self.groups = [_Group(list(range(b, min(b + size, len(self.views)))), self.views,
                                  self.request.attention_from) for b in range(0, len(self.views), size)]
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        if self._fusable(query, attention_mask, softcap) and rows_kernel.KERNEL.attempt(
                query, self._record_statistics, layer, query, key, heads, scaling):
            return
        per_kv = query.shape[1] // key.shape[1]  # query heads per key head
        if heads == list(range(query.shape[1])):  # every head: no copies; the key heads are
            q_sel, k_sel = query, key  # shared by their query heads in the product (_record_group)
        else:
            if (layer, query.device) not in self.head_index:
                self.head_index[layer, query.device] = on_device(heads, query.device)
            h_idx = self.head_index[layer, query.device]
            q_sel = query.index_select(1, h_idx)
            k_sel = key.index_select(1, torch.div(h_idx, per_kv, rounding_mode="floor"))
        for group in self.groups:
            if len(group.index) == query.shape[0]:
                q, k, mask = q_sel, k_sel, attention_mask
            else:
                q, k = q_sel[group.index], k_sel[group.index]
                # a mask of one row serves every sample (no padding; a sliding window still applies)
                mask = attention_mask if attention_mask is None or attention_mask.shape[0] == 1 else \
                    attention_mask[group.index]
            self._record_group(group, layer, q, k, mask, scaling, softcap)

    def _record_group(self, group: _Group, layer: int, q_sel, k_sel, attention_mask, scaling, softcap) -> None:
        import torch

        positions = group.query_positions(q_sel.device)  # [B, Q]
        batch, n_rows, longest = positions.shape[0], positions.shape[1], max(group.lengths)
        n_heads, n_kv = q_sel.shape[1], k_sel.shape[1]
        q_rows = q_sel.gather(2, (positions - self.offset)[:, None, :, None].expand(
            batch, n_heads, n_rows, q_sel.shape[-1]))
        # [B, H, Q, K], scaled as the queries go in (one pass less over the scores); the queries of the heads that
        # share a key head (grouped-query attention: query head h reads key head h // (H / KV)) in one product
        q_rows = (q_rows.float() * scaling).reshape(batch, n_kv, (n_heads // n_kv) * n_rows, q_rows.shape[-1])
        scores = torch.matmul(q_rows, k_sel[:, :, :longest].float().transpose(-1, -2)).reshape(
            batch, n_heads, n_rows, longest)
        scaling = 1.0
        mask = None
        if attention_mask is not None:
            mask = attention_mask[..., :longest]
            mask = mask.expand(batch, -1, -1, -1).gather(
                2, (positions - self.offset)[:, None, :, None].expand(batch, mask.shape[1], n_rows, longest))
        rows = group.rows
        rows.probs = attention_probs(scores, scaling, softcap, mask, positions[:, None, :, None])
        if self.request.keep_attention:
            group.kept[layer] = rows.probs if self.request.attention_from == "all" else rows.response()
        self._keep(group, {name: REDUCERS[name].fn(rows) for name in self.request.reducers}, q_sel)
        rows.probs = None

    def _keep(self, group: _Group, outputs: dict, like) -> None:
        """Keep one layer's reducer outputs; a reducer with ``finish`` waits until its partials reach the budget."""
        for name, out in outputs.items():
            if REDUCERS[name].finish is None:
                group.reduced.setdefault(name, []).append(out)
                continue
            waiting = group.partial.setdefault(name, [])
            waiting.append(out)
            if sum(t.numel() * t.element_size() for p in waiting for t in p.values()) > self._budget(like):
                self._finish(group, name)

    def _fusable(self, query, attention_mask, softcap) -> bool:
        """Whether this layer's reducers can come from the GPU kernel's statistics (:mod:`halwatch.signals.
        rows_kernel`): on a GPU with Triton, the whole batch in one group, rows of the response only and not kept,
        no cached prefix, no soft-capping, reducers the statistics serve, and the layer's mask the plain causal
        mask of a right-padded batch (checked once per mask)."""
        if not (query.is_cuda and not softcap and self.offset == 0 and len(self.groups) == 1
                and self.request.attention_from == "response" and not self.request.keep_attention
                and set(self.request.reducers) <= set(reducer_lib.FROM_STATISTICS)
                and rows_kernel.KERNEL.get() is not None):
            return False
        if id(attention_mask) not in self.plain_mask:
            self.plain_mask[id(attention_mask)] = (attention_mask, _plain_causal(attention_mask, self.groups[0]))
        return self.plain_mask[id(attention_mask)][1]

    def _record_statistics(self, layer: int, query, key, heads, scaling) -> bool:
        """:meth:`_record_group` through the GPU kernel: the rows are never made (True: done)."""
        import torch

        group = self.groups[0]
        rows = group.rows
        rows.device = query.device
        if layer not in self.kernel_heads:
            self.kernel_heads[layer] = on_device(heads, query.device, torch.int32)
        if self.layout is None:  # the kernel's [B] int32 layout, made once per batch
            self.layout = [t.to(torch.int32) for t in (rows.tensor("n_prompt"), reducer_lib.context_length(rows),
                                                       rows.tensor("length"))]
        stats = rows_kernel.rows(query, key, self.kernel_heads[layer], *self.layout, rows.r_max, scaling)
        self._keep(group, reducer_lib.from_statistics(rows, stats, self.request.reducers), query)
        return True

    @staticmethod
    def _finish(group: _Group, name: str) -> None:
        waiting = group.partial.pop(name, [])
        if waiting:
            group.reduced.setdefault(name, []).append(REDUCERS[name].finish(waiting))

    def finish(self) -> None:
        """Queue what is left of the reducers' work (Prim's algorithm on the last layers) on the device."""
        for group in self.groups or ():
            for name in self.request.reducers:
                self._finish(group, name)

    @timed("capture: assemble")
    def assemble(self) -> list[tuple[np.ndarray | None, dict[str, np.ndarray]]]:
        """Each sample's ``(attention rows, reducer fields)``: the fields of every layer joined along the heads,
        copied off the device once per group of samples, then cut to each sample's response."""
        import torch

        layers = sorted(self.by_layer)  # the model runs its layers in order, so outputs are in this order
        results: list = [None] * len(self.views)
        self.finish()
        for group in self.groups or ():
            batch = {}
            for name in self.request.reducers:
                outputs = group.reduced[name]
                batch.update({f"{name}.{k}": torch.cat([o[k] for o in outputs], dim=1).float() for k in outputs[0]})
            if self.request.keep_attention:
                batch["kept"] = torch.cat([group.kept[layer] for layer in layers], dim=1)
            batch = to_host(batch)
            kept = batch.pop("kept", None)
            for j, (b, view) in enumerate(zip(group.index, group.views)):  # copies: no view keeps a batch's buffer
                n_resp, length = view.n_response, group.lengths[j]
                reduced = {k: (v[j, :, :n_resp] if v.ndim == 3 else v[j]).copy() for k, v in batch.items()}
                attention = None
                if kept is not None:
                    n_rows = length if self.request.attention_from == "all" else n_resp
                    attention = kept[j, :, :n_rows, :length].copy()
                results[b] = (attention, reduced)
        return results


def _plain_causal(mask, group: _Group) -> bool:
    """Whether a layer's mask (``None``, boolean or additive ``[B or 1, heads or 1, T, K]``) lets the query at each
    real position ``p`` of sample ``b`` see exactly the keys ``k <= p`` with ``k < length[b]`` (right padding, no
    sliding window), as :mod:`halwatch.signals.rows_kernel` assumes. One wait for the device."""
    import torch

    if mask is None:  # the model's causal mask, no padding
        return True
    longest = max(group.lengths)
    if mask.dim() != 4 or mask.shape[-2] < longest or mask.shape[-1] < longest:
        return False
    mask = mask[..., :longest, :longest]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    pos = torch.arange(longest, device=mask.device)
    length = on_device(group.lengths, mask.device)[:, None, None, None]
    expected = (pos[None, None, None, :] <= pos[None, None, :, None]) & (pos[None, None, None, :] < length)
    real_row = pos[None, None, :, None] < length
    return bool(((allowed == expected) | ~real_row).all())


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """SDPA attention (explicit products while relevance is propagated, or where the logits are soft-capped), plus
    capture of the requested heads' rows when a capture is active."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    softcap = kwargs.pop("softcap", None)
    capture = _ACTIVE.get()
    if capture is not None:
        capture.record(module, query.detach(), key.detach(), attention_mask, scaling, softcap)
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
    capture = _Capture(SignalRequest(heads=heads, attention_from="all", keep_attention=True), [view])
    weight = next(model.parameters())
    device = weight.device
    with torch.inference_mode():
        token = _ACTIVE.set(capture)
        try:
            model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
        finally:
            _ACTIVE.reset(token)
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


def _check_seen(capture: _Capture, model) -> None:
    """Refuse an architecture whose attention modules did not all reach the capture."""
    if capture.seen != set(capture.by_layer):
        missing = sorted(set(capture.by_layer) - capture.seen)
        raise ModelError(f"{architecture(model)}: the attention of layer(s) {missing} was not captured (its "
                         f"attention modules do not name their layer): halwatch cannot read this architecture's "
                         f"attention")


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
    installed = getattr(model.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
    if (request.heads or rel is not None) and not installed:  # plain passes run in the model's own attention
        install(model)
    cache, offset = past if past is not None else (None, 0)
    if offset and (offset >= min(v.n_prompt for v in views) or request.attention_from == "all"):
        raise ValueError(f"a cached prefix of {offset} tokens leaves no room for the signals asked for")
    lengths = [len(v.input_ids) for v in views]
    longest = max(lengths)
    ids, mask = padded(views, scoring_model.tokenizer.pad_token_id or 0, offset)
    device = scoring_model.device
    ids, mask = ids.to(device), mask.to(device)
    if rel is not None and cache is not None:
        raise ValueError("relevance needs the whole input in the pass, not a cached prefix")
    # logits only where they are used: the positions that predict response tokens
    first_needed = min(v.n_prompt for v in views) - 1
    keep = longest - first_needed if request.token_stats or rel is not None else 1
    attn_mask = mask if len(views) > 1 or min(lengths) < longest else None
    capture = _Capture(request, views, offset) if request.heads else None
    with contextlib.ExitStack() as stack:
        if rel is None:
            stack.enter_context(torch.inference_mode())
            inputs = {"input_ids": ids}
        else:  # with gradients and the propagation rules, from the input embeddings on
            stack.enter_context(torch.enable_grad())
            stack.enter_context(lrp.rules(model, rel.method))
            embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
            inputs = {"inputs_embeds": embeds}
        token = _ACTIVE.set(capture)
        try:
            out = model(**inputs, attention_mask=attn_mask, past_key_values=cache,
                        output_hidden_states=bool(request.hidden_layers or request.token_hidden_layers),
                        logits_to_keep=keep,
                        use_cache=cache is not None)
        finally:
            _ACTIVE.reset(token)
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
    batch = _batch_outputs(out, views, request, offset, longest - keep)
    captured = capture.assemble() if capture is not None else None
    results = []
    for b, v in enumerate(views):
        sig = Signals(n_prompt=v.n_prompt, n_response=v.n_response, heads=request.heads,
                      hidden_layers=request.hidden_layers, token_hidden_layers=request.token_hidden_layers,
                      **{name: per_sample[b] for name, per_sample in batch.items()})
        if capture is not None:
            sig.attention, sig.reduced = captured[b]
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


#: Per thread, the page-locked buffers that :func:`to_host` and :func:`upload` copy through, grown as needed and
#: kept: allocating page-locked memory costs milliseconds per call (5.7 ms each on an H200 host), a batch's worth of
#: answers.
_STAGING = threading.local()
_UPLOADS = threading.local()  # and the event of its last copy


def _staging(nbytes: int, store=_STAGING):
    """``store``'s page-locked buffer of at least ``nbytes`` bytes (doubled when it grows)."""
    import torch

    buffer = getattr(store, "buffer", None)
    if buffer is None or buffer.numel() < nbytes:
        buffer = store.buffer = torch.empty(max(nbytes, 2 * (0 if buffer is None else buffer.numel())),
                                            dtype=torch.uint8, pin_memory=True)
    return buffer


@timed("copies off the device")
def to_host(tensors: dict) -> dict:
    """``{name: numpy array}`` of ``{name: tensor}``: from a GPU through this thread's page-locked buffer, all
    copies queued before one wait (a copy into ordinary memory runs at a fraction of the bus's speed and waits each
    time). The arrays of a GPU's tensors are views of that buffer, valid until this thread's next call: copy what
    is kept."""
    import torch

    devices = {t.device.type for t in tensors.values()}
    if devices != {"cuda"}:
        return {k: t.cpu().numpy() for k, t in tensors.items()}
    tensors = {k: t.contiguous() for k, t in tensors.items()}
    starts, end = {}, 0
    for k, t in tensors.items():
        starts[k] = end
        end += -(-t.numel() * t.element_size() // 64) * 64  # every array 64-byte aligned
    buffer = _staging(end)
    host = {}
    for k, t in tensors.items():
        host[k] = buffer[starts[k]:starts[k] + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        host[k].copy_(t, non_blocking=True)
    torch.cuda.current_stream(next(iter(tensors.values())).device).synchronize()
    return {k: t.numpy() for k, t in host.items()}


def upload(arrays, device):
    """``arrays`` (one array, or a list of arrays stacked along their first axis: ``[R_i, ...]`` each) as one tensor
    on ``device``, copied without a wait. On a GPU the arrays are copied straight into this thread's page-locked
    buffer (grown as needed and kept), never joined in ordinary memory first: a copy from ordinary memory runs at a
    fraction of the bus's speed (on an H100 the token model's inputs took 54 ms of device time per 256 answers that
    way). The buffer is refilled only once its last copy is done."""
    import torch

    parts = [arrays] if isinstance(arrays, np.ndarray) else list(arrays)
    if device.type != "cuda":
        return torch.from_numpy(np.concatenate(parts) if len(parts) > 1 else np.ascontiguousarray(parts[0])).to(device)
    if getattr(_UPLOADS, "event", None) is not None:
        _UPLOADS.event.synchronize()
    first = torch.from_numpy(np.ascontiguousarray(parts[0][:0]))
    shape = (sum(len(p) for p in parts), *first.shape[1:])
    nbytes = int(np.prod(shape)) * first.element_size()
    staged = _staging(nbytes, _UPLOADS)[:nbytes].view(first.dtype).view(shape)
    row = 0
    for part in parts:
        staged[row:row + len(part)].copy_(torch.from_numpy(np.ascontiguousarray(part)))
        row += len(part)
    out = staged.to(device, non_blocking=True)
    _UPLOADS.event = torch.cuda.Event()
    _UPLOADS.event.record(torch.cuda.current_stream(device))
    return out


#: Response rows whose next-token distributions are normalised at a time on a GPU: bounds the float32 copy of the
#: logits (100 MB for a 49,152-token vocabulary).
LOGIT_ROWS = 512

#: On a CPU, the float32 logits normalised at a time: pieces that stay in the cache. For 220 response rows of a
#: 49,152-token vocabulary on a 2-core EPYC (1 MB L2 per core, 32 MB L3) the log-probabilities and entropies took
#: 48 ms in pieces of 512 rows (100 MB), 20 ms in pieces of 64 and 11 ms in pieces of 16 (3 MB), the same numbers.
CPU_LOGIT_BYTES = 4 << 20


def _logit_rows(logits) -> int:
    """How many rows of ``logits`` (``[..., vocabulary]``) to normalise at a time on their device."""
    if logits.device.type != "cpu":
        return LOGIT_ROWS
    return max(1, CPU_LOGIT_BYTES // (4 * logits.shape[-1]))


def _token_stats(logits, views: list[TokenView], first_logit: int, sample, position, target):
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
    step = _logit_rows(logits)
    for b, v in enumerate(views):  # each sample's rows are one slice of its logits: no copy of them
        rows = logits[b, v.n_prompt - 1 - first_logit : len(v.input_ids) - 1 - first_logit]
        for lo in range(0, len(rows), step):
            logp = torch.log_softmax(rows[lo:lo + step].float(), -1)
            logprobs.append(logp.gather(1, target[done + lo : done + lo + len(logp), None])[:, 0])
            entropy.append(-logp.exp().mul_(logp).sum(-1))  # p log p, in p's own memory
        done += v.n_response
    return torch.cat(logprobs), torch.cat(entropy)


@timed("token statistics, hidden states")
def _batch_outputs(out, views: list[TokenView], request: SignalRequest, offset: int, first_logit: int) -> dict:
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
        fields["logprobs"], fields["entropy"] = _token_stats(out.logits.detach(), views, first_logit, sample,
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
