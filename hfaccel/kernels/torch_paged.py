"""Pure-PyTorch paged attention: the reference backend and the CPU fast path.

Decodes on a CPU run a small C kernel (`cpu_decode`) that reads each sequence's K/V rows in place
through its block table, for a float32 query over a float32 or bfloat16 cache and a bfloat16 query over
a bfloat16 cache (verification rows of several queries each as a sequence of its own visible length);
otherwise (float16, other devices, no C compiler) they run as one batched SDPA call over K/V gathered
from the cache by whole blocks and padded to the longest context. Multi-token sequences (prefill chunks) run one SDPA
call each: a fresh prompt attends to its own K/V with ``is_causal``; a chunk that continues a cached
context gathers that context and uses an offset causal mask. Everything a layer needs is derived once
per step by the builder, from host-side ints (no device sync), and shared by all layers.

Padded tokens (slot ``-1``) are written to a scratch block past the usable ones (`kv_cache_shape`
reserves it), so the store needs no data-dependent indexing; padded sequences are skipped (zero rows).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hfaccel.kernels import cpu_decode, kv_quant
from hfaccel.kernels.metadata import (
    AttentionBackend,
    AttentionMetadata,
    BackendCapabilities,
    MetadataBuilder,
    StepLayout,
)


@dataclass
class PrefillSpan:
    """One multi-token sequence of a step."""

    start: int  # first packed token of this sequence
    length: int  # its query tokens this step
    context_slots: torch.Tensor | None  # [ctx] cache slots when it continues a cached context
    mask: torch.Tensor | None  # [length, ctx] True where attention is allowed
    # The mask of a local layer, by (window, chunk) (made by the first layer of that kind that asks).
    _local: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def local_mask(self, window: int, chunk: int, device: torch.device) -> torch.Tensor:
        """``[length, ctx]`` True where a query sees a key causally and locally: within `window`
        positions (key > query - window, transformers' sliding rule) and in the query's chunk of `chunk`
        positions (key // chunk == query // chunk, its chunked rule); 0: no such limit."""
        mask = self._local.get((window, chunk))
        if mask is None:
            context = self.length if self.context_slots is None else self.context_slots.shape[0]
            keys = torch.arange(context, device=device)
            queries = keys[context - self.length :, None]
            mask = keys[None, :] >= local_start(queries, window, chunk)
            mask &= keys[None, :] <= queries
            self._local[(window, chunk)] = mask
        return mask


@dataclass
class TorchMetadata:
    """The common metadata plus the torch backend's gather indices and masks for this step."""

    common: AttentionMetadata
    # Decode rows with up to Q > 1 queries (speculative verification): each sequence's queries padded to
    # Q (`decode_query_index` into the packed tokens), and where the real rows' outputs go.
    decode_queries: int = 1
    decode_query_index: torch.Tensor | None = None  # [num_decodes * Q]
    decode_out_src: torch.Tensor | None = None  # rows of the [num_decodes * Q] output that are real
    decode_out_dst: torch.Tensor | None = None  # their packed token index
    decode_row_seqs: torch.Tensor | None = None  # each real row's sequence (in decode order)
    decode_row_lens: torch.Tensor | None = None  # each real row's visible context (its position + 1)
    prefills: list[PrefillSpan] = field(default_factory=list)
    # The decode rows' gather (`decode_blocks`, `decode_mask`, `decode_last`) and `write_slots`, made
    # when a layer first reads them: a step whose decodes the C kernel serves needs neither (a few
    # tensor ops each, the host cost of a small model's step).
    _gather: Callable[[], tuple[torch.Tensor, ...]] | None = field(default=None, repr=False)
    _gathered: tuple[torch.Tensor | None, ...] | None = field(default=None, repr=False)
    _slots: Callable[[], torch.Tensor] | torch.Tensor | None = field(default=None, repr=False)
    # The additive form of `decode_mask` (0 where visible, -inf elsewhere), rows repeated for the query
    # heads sharing a KV head: made by the first layer that asks (`decode_bias`) and shared by every
    # other layer of the step, so SDPA converts no boolean mask per layer.
    _decode_bias: dict[tuple[torch.dtype, int, int, int], torch.Tensor] = field(
        default_factory=dict, repr=False
    )
    # The C kernel bound to this step's one-token decode rows, by the first layer that asks (False: the
    # kernel does not serve this step's decodes).
    _cpu_decode: cpu_decode.DecodeCall | bool | None = field(default=None, repr=False)
    # The same for multi-query decode rows (speculative verification): each real row as its own
    # one-token "sequence" over its sequence's blocks, seeing the context up to its own position.
    _cpu_rows: cpu_decode.DecodeCall | bool | None = field(default=None, repr=False)

    @property
    def decode_blocks(self) -> torch.Tensor | None:
        """``[num_decodes * nb]`` block ids, nb the longest context's blocks (None: no decode rows)."""
        return self._decode_gather()[0]

    @property
    def decode_mask(self) -> torch.Tensor | None:
        """``[num_decodes, 1, Q, nb * block_size]``: True where a decode query sees a key."""
        return self._decode_gather()[1]

    @property
    def decode_last(self) -> torch.Tensor | None:
        """Each decode query's own position ``[num_decodes, 1, Q, 1]`` (a local layer's window ends there)."""
        return self._decode_gather()[2]

    @property
    def write_slots(self) -> torch.Tensor | None:
        """``slot_mapping`` with padding sent to the scratch block (`MetadataBuilder.write_slots`)."""
        if callable(self._slots):
            self._slots = self._slots()
        return self._slots

    def _decode_gather(self) -> tuple[torch.Tensor | None, ...]:
        if self._gathered is None:
            self._gathered = (None, None, None) if self._gather is None else self._gather()
        return self._gathered

    def cpu_decode_call(self, query: torch.Tensor, k_cache: torch.Tensor) -> cpu_decode.DecodeCall | None:
        """The C kernel bound to the step's first ``num_decodes`` rows (one token each: their block
        tables, lengths and slots), or None where it does not serve them; shared by every layer."""
        if self._cpu_decode is None:
            common = self.common
            rows = common.num_decodes
            serves = self.decode_queries == 1 and rows > 0 and cpu_decode.supports(query, k_cache)
            self._cpu_decode = (
                cpu_decode.DecodeCall(
                    common.block_tables[:rows],
                    common.seq_lens[:rows],
                    common.max_seq_len,
                    common.slot_mapping[:rows],
                )
                if serves
                else False
            )
        return self._cpu_decode or None

    def cpu_decode_rows_call(
        self, query: torch.Tensor, k_cache: torch.Tensor
    ) -> cpu_decode.DecodeCall | None:
        """The C kernel bound to the step's multi-query decode rows (the real ones, in
        `decode_out_dst` order; their K/V stored first by `write_kv`), or None where it does not serve
        them; shared by every layer."""
        if self._cpu_rows is None:
            serves = self.decode_queries > 1 and self.decode_row_lens is not None
            serves = serves and cpu_decode.supports(query, k_cache)
            self._cpu_rows = (
                cpu_decode.DecodeCall(
                    self.common.block_tables.index_select(0, self.decode_row_seqs),
                    self.decode_row_lens,
                    self.common.max_seq_len,
                )
                if serves
                else False
            )
        return self._cpu_rows or None

    def decode_bias(self, dtype: torch.dtype, rep: int, window: int = 0, chunk: int = 0) -> torch.Tensor:
        """``[num_decodes, 1, rep * Q, nb * block_size]`` additive mask in `dtype` (built once per step
        and kind of layer); rows are ordered ``(head in group, query)`` as `_decode` lays out its
        queries. `window`, `chunk` > 0: each query sees only its local keys (`local_start`)."""
        key = (dtype, rep, window, chunk)
        bias = self._decode_bias.get(key)
        if bias is None:
            mask = self.decode_mask
            if window > 0 or chunk > 0:
                slots = torch.arange(mask.shape[-1], device=mask.device)
                mask = mask & (slots >= local_start(self.decode_last, window, chunk))
            mask = mask if self.decode_queries == 1 else mask.repeat(1, 1, rep, 1)
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._decode_bias[key] = bias
        return bias


def local_start(position: torch.Tensor, window: int, chunk: int) -> torch.Tensor:
    """The first key position a query at `position` sees in a local layer: the later of its sliding
    window's start (``position - window + 1``) and its chunk's (``position // chunk * chunk``)."""
    start = torch.zeros_like(position)
    if window > 0:
        start = torch.clamp(position - window + 1, min=0)
    if chunk > 0:
        start = torch.maximum(start, position // chunk * chunk)
    return start


def context_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of token `positions` for a block table (works batched: ``[B, nb]`` with ``[S]``)."""
    return block_table[..., positions // block_size] * block_size + positions % block_size


class TorchMetadataBuilder(MetadataBuilder):
    """Builds `TorchMetadata`; padding slots are redirected to the scratch block."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._positions = torch.arange(self.max_blocks_per_seq * self.block_size, device=self.device)

    def build(
        self, layout: StepLayout, num_padded_seqs: int | None = None, num_padded_tokens: int | None = None
    ) -> TorchMetadata:
        common = self.build_common(layout, num_padded_seqs, num_padded_tokens)
        meta = TorchMetadata(common)
        block_size = self.block_size
        meta._slots = functools.partial(self.write_slots, common)
        block_tables = common.block_tables
        num_decodes = common.num_decodes
        if num_decodes:
            lens = layout.seq_lens[:num_decodes]
            queries = layout.query_lens[:num_decodes]
            if max(queries) == 1:
                meta._gather = functools.partial(self._decode_gather, block_tables, lens)
            else:
                self._verification_rows(meta, block_tables, lens, queries)
        start = common.num_decode_tokens
        tables = block_tables.long() if num_decodes < common.num_seqs else block_tables
        for i in range(num_decodes, common.num_seqs):
            length = layout.query_lens[i]
            context = layout.seq_lens[i]
            if context == length:
                meta.prefills.append(PrefillSpan(start, length, None, None))
            else:
                positions = self._positions[:context]
                slots = context_slots(tables[i], positions, block_size)
                mask = positions[None, :] <= positions[context - length :, None]
                meta.prefills.append(PrefillSpan(start, length, slots, mask))
            start += length
        return meta

    def _decode_gather(self, block_tables: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, ...]:
        """One-token decode rows: the whole blocks to gather (contiguous rows of block_size * Hkv * D, far
        faster than single slots), which keys each row sees, and its position."""
        nb = -(-max(lens) // self.block_size)
        blocks = block_tables[: len(lens), :nb].reshape(-1).long()
        seen = torch.tensor(lens, device=self.device)
        mask = (self._positions[: nb * self.block_size][None, :] < seen[:, None])[:, None, None, :]
        return blocks, mask, (seen - 1)[:, None, None, None]

    def _verification_rows(
        self, meta: TorchMetadata, block_tables: torch.Tensor, lens: list[int], queries: list[int]
    ) -> None:
        """Decode rows of up to Q > 1 queries (speculative verification): each sequence's queries padded
        to Q, the real rows' places, and what the gather needs (built now: such steps are few)."""
        device = self.device
        num_decodes = len(lens)
        nb = -(-max(lens) // self.block_size)
        slots = self._positions[: nb * self.block_size]
        q_max = max(queries)
        index, last_position, src, dst, row_seqs, row_lens = [], [], [], [], [], []
        start = 0
        for b, (q, length) in enumerate(zip(queries, lens)):
            for i in range(q_max):
                j = min(i, q - 1)  # padding rows repeat the last query; their output is dropped
                index.append(start + j)
                last_position.append(length - q + j)
                if i < q:
                    src.append(b * q_max + i)
                    dst.append(start + i)
                    row_seqs.append(b)
                    row_lens.append(length - q + i + 1)
            start += q
        visible = torch.tensor(last_position, device=device).view(num_decodes, q_max)
        blocks = block_tables[:num_decodes, :nb].reshape(-1).long()
        meta._gathered = (
            blocks,
            (slots[None, None, :] <= visible[:, :, None])[:, None],
            visible[:, None, :, None],
        )
        meta.decode_queries = q_max
        meta.decode_query_index = torch.tensor(index, device=device)
        meta.decode_out_src = torch.tensor(src, device=device)
        meta.decode_out_dst = torch.tensor(dst, device=device)
        meta.decode_row_seqs = torch.tensor(row_seqs, device=device)
        meta.decode_row_lens = torch.tensor(row_lens, dtype=torch.int32, device=device)


class TorchPagedAttention(AttentionBackend):
    """Paged attention written with ``torch`` ops only (any device, any float dtype)."""

    name = "torch"
    capabilities = BackendCapabilities(
        # int8: quantized rows with a scale each (`kv_quant`), read back as the query's dtype.
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8}),
        head_dims=None,
        devices=frozenset({"cpu", "cuda", "mps", "xpu"}),
        cuda_graph_decode=False,  # gather sizes follow the longest context: not one shape per bucket
        decode_query_len=8,  # verification rows of 1 + k tokens (k <= 7) share the batched decode call
        sliding_window=True,
        chunked_attention=True,
        logit_softcap=True,
        attention_sinks=True,
    )
    builder_class = TorchMetadataBuilder
    uses_scratch_block = True

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: TorchMetadata,
        scale: float,
        window: int = 0,
        chunk: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        common = meta.common
        local = (window, chunk, softcap, sinks)
        call = meta.cpu_decode_call(query, k_cache)
        if call is not None and common.num_decodes == common.num_seqs:
            # Decodes only: the kernel stores their K/V and attends in one call; padding rows stay zero.
            rows = common.num_decodes
            if rows == query.shape[0]:  # no padding: no views to make (30 layers a step)
                return call(query, k_cache, v_cache, scale, torch.empty_like(query), key, value, *local)
            out = torch.zeros_like(query)
            call(query[:rows], k_cache, v_cache, scale, out[:rows], key[:rows], value[:rows], *local)
            return out
        write_kv(k_cache, v_cache, key, value, meta.write_slots)
        return attend(query, key, value, k_cache, v_cache, meta, scale, *local)

    def forward_heads_first(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: TorchMetadata,
        scale: float,
        window: int = 0,
        chunk: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """A step of one-token decodes only, unpadded, that the C kernel serves: one call, reading the
        head-first tensors in place (the common case of an eager CPU decode step)."""
        common = meta.common
        if common.num_decodes != common.num_seqs or common.num_decodes != query.shape[2]:
            return None
        # Autocast: the op casts the query to the cache's dtype first, and the kernel is bound (once a
        # step) for the dtypes it sees then, not these.
        if torch.is_autocast_enabled("cpu"):
            return None
        call = meta._cpu_decode
        if call is None:  # the step's first layer: bind the kernel (`cpu_decode_call`)
            call = meta.cpu_decode_call(query[0].transpose(0, 1), kv_cache[0])
        if not call:
            return None
        return call.heads_first(query, key, value, *kv_cache, scale, window, chunk, softcap, sinks)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into the paged cache at `slots` (all valid; quantized
    where the cache is int8)."""
    if k_cache.dtype == kv_quant.QUANTIZED_DTYPE:
        kv_quant.store(k_cache, slots, key)
        kv_quant.store(v_cache, slots, value)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TorchMetadata,
    scale: float,
    window: int = 0,
    chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention; ``query`` ``[T, Hq, D]`` -> a new ``[T, Hq, D]``. `window` > 0: a sliding
    window, each query seeing the keys of its last `window` positions (itself included); `chunk` > 0:
    chunked attention, each query seeing the keys of its own chunk of `chunk` positions; `softcap` > 0:
    scores soft-capped (``softcap * tanh(score / softcap)``, Gemma 2); `sinks` ``[Hq]``: each head's
    attention-sink logit joins its softmax's denominator (gpt-oss)."""
    exact = (softcap, sinks)  # beyond what SDPA computes: the explicit softmax (`_softmax_attention`)
    common = meta.common
    num_kv_heads, width = k_cache.shape[2], k_cache.shape[3]
    head_dim = query.shape[-1]
    # Decode rows on a CPU in the dtypes it serves go to the C kernel, which reads the blocks in place (no
    # gathered copy, no mask; a step of one-token decodes only never gets here: `forward` runs it through
    # the kernel, store included; multi-query rows each as a sequence of their own visible length);
    # elsewhere, batched SDPA over the gathered blocks.
    kernel = meta.cpu_decode_call(query, k_cache)
    if (
        kernel is None
        and meta.decode_queries == 1
        and 0 < common.num_decodes == common.num_padded_tokens
        and query.is_contiguous()
    ):
        # Every row is a one-token decode (no padding, no prefill): SDPA's output, viewed as [T, Hq, D], is
        # the result (contiguous, as the op's fake implementation promises a compiled graph).
        return _decode(query, k_cache, v_cache, meta, scale, window, chunk, *exact)
    out = (
        torch.empty_like(query) if common.num_padded_tokens == common.num_tokens else torch.zeros_like(query)
    )
    if common.num_decodes:  # padded sequences are skipped: their rows stay zero
        d = common.num_decodes
        if kernel is not None:  # their K/V are stored already (write_kv)
            kernel(query[:d], k_cache, v_cache, scale, out[:d], None, None, window, chunk, *exact)
        elif meta.decode_queries == 1:
            out[:d] = _decode(query[:d], k_cache, v_cache, meta, scale, window, chunk, *exact)
        elif (rows_kernel := meta.cpu_decode_rows_call(query, k_cache)) is not None:
            queries = query.index_select(0, meta.decode_out_dst)
            rows = rows_kernel(
                queries, k_cache, v_cache, scale, torch.empty_like(queries), None, None, window, chunk, *exact
            )
            out.index_copy_(0, meta.decode_out_dst, rows)
        else:
            queries = query.index_select(0, meta.decode_query_index)
            rows = _decode(queries, k_cache, v_cache, meta, scale, window, chunk, *exact)
            out.index_copy_(0, meta.decode_out_dst, rows.index_select(0, meta.decode_out_src))
    flat_k = k_cache.view(-1, num_kv_heads, width)
    flat_v = v_cache.view(-1, num_kv_heads, width)
    quantized = k_cache.dtype == kv_quant.QUANTIZED_DTYPE
    for span in meta.prefills:
        # 4-D inputs: CPU SDPA sends 3-D ones to its slow math path (25x slower at 2k tokens).
        rows = slice(span.start, span.start + span.length)
        q = query[rows].transpose(0, 1)[None]  # [1, Hq, L, D]
        context = span.length if span.context_slots is None else span.context_slots.shape[0]
        local = 0 < window < context or 0 < chunk < context  # some query cannot see every earlier key
        mask = span.local_mask(window, chunk, query.device) if local else span.mask
        if span.context_slots is None:
            k, v = key[rows], value[rows]
            if quantized:  # what a later step reads back: a prompt attends the same whether cached or not
                k, v = kv_quant.roundtrip(k), kv_quant.roundtrip(v)
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        else:
            k = _values(flat_k[span.context_slots], head_dim, q.dtype).transpose(0, 1)[None]
            v = _values(flat_v[span.context_slots], head_dim, q.dtype).transpose(0, 1)[None]
        if softcap > 0 or sinks is not None:
            if mask is None:
                mask = torch.ones(span.length, context, dtype=torch.bool, device=q.device).tril(
                    context - span.length
                )
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            row_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)
            o = _softmax_attention(q, k, v, torch.where(mask, 0.0, float("-inf")), scale, softcap, row_sinks)
        elif mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out


def _softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention written out, in transformers' eager order: scaled scores, soft-capped, masked (additive
    `bias`), then a softmax whose denominator also holds each row's attention-sink logit (`sinks`,
    broadcast to ``[..., rows, 1]``), in float32."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + bias
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: TorchMetadata,
    scale: float,
    window: int = 0,
    chunk: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``query`` ``[B * Q, Hq, D]`` (Q queries per sequence) over each sequence's gathered blocks."""
    # Query heads sharing a KV head become rows of one [Hkv, rep * Q] group: no repeat of K/V is needed.
    rows, num_heads, head_dim = query.shape
    q_len = meta.decode_queries
    num_seqs = rows // q_len
    num_kv_heads = k_cache.shape[2]
    rep = num_heads // num_kv_heads
    q = query.view(num_seqs, q_len, num_kv_heads, rep, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(num_seqs, num_kv_heads, rep * q_len, head_dim)
    shape = (num_seqs, -1, num_kv_heads, k_cache.shape[3])
    k = _values(k_cache.index_select(0, meta.decode_blocks).view(shape), head_dim, q.dtype)
    k = k.permute(0, 2, 1, 3)  # [B, Hkv, S, D]
    v = _values(v_cache.index_select(0, meta.decode_blocks).view(shape), head_dim, q.dtype)
    v = v.permute(0, 2, 1, 3)
    bias = meta.decode_bias(q.dtype, rep, window, chunk)  # rows: (rep, Q); built by the step's first layer
    if softcap > 0 or sinks is not None:  # rows (rep, Q): head h * rep + r's sink on its Q rows
        row_sinks = (
            None if sinks is None else sinks.view(1, num_kv_heads, rep, 1, 1).expand(-1, -1, -1, q_len, 1)
        )
        row_sinks = None if row_sinks is None else row_sinks.reshape(1, num_kv_heads, rep * q_len, 1)
        o = _softmax_attention(q, k, v, bias, scale, softcap, row_sinks)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)  # [B, Hkv, rep * Q, D]
    o = o.view(num_seqs, num_kv_heads, rep, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(rows, num_heads, head_dim)


def _values(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as values of `dtype`: dequantized from an int8 cache, else cast (kept here, not in
    `kv_quant`, so a float cache's step runs no code of that module)."""
    if rows.dtype == kv_quant.QUANTIZED_DTYPE:
        return kv_quant.dequantize(rows, head_dim, dtype)
    return rows.to(dtype)
