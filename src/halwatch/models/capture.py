"""The capture of attention rows inside the forward pass (:mod:`halwatch.models.forward`): for the requested
``(layer, head)`` pairs only, the softmax rows recomputed from the query and key states each layer already computed,
and the per-head reducers (:mod:`halwatch.signals.reducers`) run on them layer by layer on the model's device."""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from halwatch.models.masking import attention_probs
from halwatch.models.signal_types import SignalRequest
from halwatch.models.transfer import to_host
from halwatch.signals import reducers as reducer_lib
from halwatch.signals import rows_kernel
from halwatch.signals.reducers import REDUCERS, Rows, on_device
from halwatch.timing import timed
from halwatch.tokens import TokenView

#: Bytes of partial reducer results (e.g. MTop-Div's distances) held before they are finished together.
PARTIAL_BUDGET = 96 << 20
#: Samples of a batch whose attention rows the capture computes together on a CPU (``None``: the whole batch, as on
#: a GPU). One: on a CPU padding costs its arithmetic, and a batch of 32 RAGTruth answers took 1.5x the time.
CPU_GROUP: int | None = 1
ACTIVE: contextvars.ContextVar = contextvars.ContextVar("halwatch_capture", default=None)


class Group:
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
        self.evidence = None  # [B, R_max, K]: the response rows of the evidence heads, summed (evidence_heads)
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


class Capture:
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
        #: layer -> where its evidence heads are among the layer's captured heads
        self.evidence_at: dict[int, list[int]] = {}
        for layer, head in request.evidence_heads:
            self.evidence_at.setdefault(layer, []).append(self.by_layer[layer].index(head))
        self.views = views
        self.groups: list[Group] | None = None  # made at the first layer, when the device is known
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
            self.groups = [Group(list(range(b, min(b + size, len(self.views)))), self.views,
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

    def _record_group(self, group: Group, layer: int, q_sel, k_sel, attention_mask, scaling, softcap) -> None:
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
        if layer in self.evidence_at:
            summed = rows.response()[:, self.evidence_at[layer]].sum(dim=1)
            group.evidence = summed if group.evidence is None else group.evidence + summed
        self._keep(group, {name: REDUCERS[name].fn(rows) for name in self.request.reducers}, q_sel)
        rows.probs = None

    def _keep(self, group: Group, outputs: dict, like) -> None:
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
                and not self.request.evidence_heads
                and set(self.request.reducers) <= set(reducer_lib.FROM_STATISTICS)
                and rows_kernel.KERNEL.get() is not None):
            return False
        if id(attention_mask) not in self.plain_mask:
            self.plain_mask[id(attention_mask)] = (attention_mask, plain_causal(attention_mask, self.groups[0]))
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
    def _finish(group: Group, name: str) -> None:
        waiting = group.partial.pop(name, [])
        if waiting:
            group.reduced.setdefault(name, []).append(REDUCERS[name].finish(waiting))

    def finish(self) -> None:
        """Queue what is left of the reducers' work (Prim's algorithm on the last layers) on the device."""
        for group in self.groups or ():
            for name in self.request.reducers:
                self._finish(group, name)

    @timed("capture: assemble")
    def assemble(self) -> list[tuple[np.ndarray | None, dict[str, np.ndarray], np.ndarray | None]]:
        """Each sample's ``(attention rows, reducer fields, evidence)``: the fields of every layer joined along the
        heads, copied off the device once per group of samples, then cut to each sample's response; the evidence
        heads' summed rows ``[R, n_prompt]`` where asked."""
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
            if group.evidence is not None:
                batch["evidence"] = group.evidence.float()
            batch = to_host(batch)
            kept = batch.pop("kept", None)
            evidence = batch.pop("evidence", None)
            for j, (b, view) in enumerate(zip(group.index, group.views)):  # copies: no view keeps a batch's buffer
                n_resp, length = view.n_response, group.lengths[j]
                reduced = {k: (v[j, :, :n_resp] if v.ndim == 3 else v[j]).copy() for k, v in batch.items()}
                attention = None
                if kept is not None:
                    n_rows = length if self.request.attention_from == "all" else n_resp
                    attention = kept[j, :, :n_rows, :length].copy()
                mine = None if evidence is None else evidence[j, :n_resp, :view.n_prompt].copy()
                results[b] = (attention, reduced, mine)
        return results


def plain_causal(mask, group: Group) -> bool:
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


@contextlib.contextmanager
def capturing(capture):
    """Within the block, halwatch's attention function (:func:`halwatch.models.forward.install`) hands every
    layer's query and key states to ``capture.record(module, query, key, attention_mask, scaling, softcap)``."""
    token = ACTIVE.set(capture)
    try:
        yield capture
    finally:
        ACTIVE.reset(token)
