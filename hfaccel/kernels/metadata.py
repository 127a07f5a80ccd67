"""What one engine step tells an attention backend, and the interface every backend implements.

The engine describes a step on the host as a `StepLayout` (plain Python ints). A backend's
`MetadataBuilder`, made once per engine, copies that layout into persistent buffers (a pinned host
mirror plus a device copy, filled in place every step: no per-step allocation of index tensors) and
returns the backend's typed metadata. Padding is one sentinel everywhere: a padded token has
``slot_mapping == -1`` (it writes no K/V) and a padded sequence has ``seq_len == 0`` (it reads
nothing); their outputs are ignored. That is what fixed grids and CUDA graphs need.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from hfaccel.kernels import kv_quant

PAD_SLOT = -1


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can serve, declared as data.

    Attributes:
        dtypes: query/KV dtypes it computes in.
        head_dims: supported head dimensions (``None``: any).
        devices: device types it runs on (``"cpu"``, ``"cuda"``).
        cuda_graph_decode: whether a pure-decode step can be captured in a CUDA graph.
        decode_query_len: the largest query length per sequence it serves on its decode path (1 for
            plain decoding; 1 + k lets speculative verification rows ride the decode path).
        sliding_window: whether `forward` serves a sliding ``window`` (per layer); a model whose layers
            use one is never given a backend that does not.
        chunked_attention: the same for a ``chunk`` (Llama 4's chunked attention layers).
        logit_softcap: the same for a ``softcap`` of the scores (Gemma 2).
        attention_sinks: the same for ``sinks``, per-head attention-sink logits (gpt-oss).
        quantized_row_align: bytes an int8 cache's rows are padded to (`kv_quant.row_width`): 4, or 16
            for kernels that load aligned vectors.
    """

    dtypes: frozenset[torch.dtype]
    head_dims: frozenset[int] | None
    devices: frozenset[str]
    cuda_graph_decode: bool
    decode_query_len: int = 1
    sliding_window: bool = False
    chunked_attention: bool = False
    logit_softcap: bool = False
    attention_sinks: bool = False
    quantized_row_align: int = 4


@dataclass
class StepLayout:
    """One packed step as the engine sees it on the host.

    ``query_lens[i]`` new tokens of sequence ``i`` are computed; ``seq_lens[i]`` is its context length
    with them; sequences served on the decode path come first (``num_decodes`` of them).
    """

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    num_decodes: int
    # Each sequence's row of a recurrent model's state (`Request.state_slot`); None for other models.
    state_slots: list[int] | None = None
    # The sliding layers' block tables and slots, where they keep K/V in a pool of their own (a model
    # with full and sliding layers: `engine/window_blocks.py`); None otherwise.
    window_block_tables: list[list[int]] | None = None
    window_slot_mapping: list[int] | None = None

    def window_view(self) -> StepLayout:
        """The step as the sliding layers see it: their own tables and slots (this layout where they
        have none)."""
        if self.window_block_tables is None:
            return self
        return StepLayout(
            self.query_lens,
            self.seq_lens,
            self.window_block_tables,
            self.window_slot_mapping or [],
            self.num_decodes,
            self.state_slots,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.slot_mapping)


@dataclass
class AttentionMetadata:
    """The step's layout in the builder's persistent buffers (views, valid until the next build).

    Device tensors have the padded sizes ``T_pad`` tokens and ``B_pad`` sequences; the ints count
    the real ones. ``*_cpu`` are the host mirrors, for backends that plan on the host.

    Attributes:
        slot_mapping: ``[T_pad]`` int64 cache slot of each token (``block * block_size + offset``);
            ``-1`` for padding.
        query_start_loc: ``[B_pad + 1]`` int32 offsets of each sequence's tokens (cu_seqlens_q).
        seq_lens: ``[B_pad]`` int32 context lengths, this step's tokens included; 0 for padding.
        block_tables: ``[B_pad, max_blocks]`` int32 block ids of each sequence (unused entries 0).
    """

    num_seqs: int
    num_tokens: int
    num_decodes: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    block_tables_cpu: torch.Tensor
    query_lens: list[int]
    host_seq_lens: list[int]

    @property
    def num_padded_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_padded_tokens(self) -> int:
        return self.slot_mapping.shape[0]


class MetadataBuilder:
    """Owns the persistent step buffers of one engine and fills them in place each step.

    Backends subclass it to derive their own typed metadata from the common one (`build`).
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        scratch_block: int | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)
        # A CUDA graph bakes in the block-table width: the runner fixes it when it captures graphs.
        self.fixed_width: int | None = None
        # Backends that store K/V with a fixed-shape scatter send padded tokens to this block.
        self.scratch_block = scratch_block
        self._write_slots = (
            None
            if scratch_block is None
            else torch.zeros(max_num_tokens, dtype=torch.int64, device=self.device)
        )
        pin = self.device.type == "cuda"
        shapes = {
            "slot_mapping": ((max_num_tokens,), torch.int64),
            "query_start_loc": ((max_num_seqs + 1,), torch.int32),
            "seq_lens": ((max_num_seqs,), torch.int32),
            "block_tables": ((max_num_seqs, max_blocks_per_seq), torch.int32),
        }
        self.host = {n: torch.zeros(s, dtype=d, pin_memory=pin) for n, (s, d) in shapes.items()}
        self._host_arrays = {n: buf.numpy() for n, buf in self.host.items()}  # made once: a step fills them
        self._table_rows: list[list[int]] = [[] for _ in range(max_num_seqs)]  # `_copy_tables`
        self._view_cache: dict[tuple[int, int, int], tuple] = {}  # `_views`
        self.dev = (
            self.host
            if self.device.type == "cpu"
            else {n: torch.zeros(s, dtype=d, device=self.device) for n, (s, d) in shapes.items()}
        )

    def build_common(
        self, layout: StepLayout, num_padded_seqs: int | None = None, num_padded_tokens: int | None = None
    ) -> AttentionMetadata:
        """Copy `layout` into the buffers, padded to the given sizes (default: no padding)."""
        b, t = layout.num_seqs, layout.num_tokens
        b_pad = b if num_padded_seqs is None else num_padded_seqs
        t_pad = t if num_padded_tokens is None else num_padded_tokens
        if not (b <= b_pad <= self.max_num_seqs and t <= t_pad <= self.max_num_tokens):
            raise ValueError(
                f"step of {b} sequences / {t} tokens padded to {b_pad} / {t_pad} does not fit the buffers "
                f"({self.max_num_seqs} sequences, {self.max_num_tokens} tokens)"
            )
        width = self.fixed_width or max(map(len, layout.block_tables), default=1) or 1
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {width} blocks exceeds {self.max_blocks_per_seq}")
        h = self._host_arrays
        h["slot_mapping"][:t] = layout.slot_mapping
        h["slot_mapping"][t:t_pad] = PAD_SLOT
        qsl = h["query_start_loc"]
        qsl[0] = 0
        total = 0
        for i, n in enumerate(layout.query_lens):
            total += n
            qsl[i + 1] = total
        # Padded tokens belong to padded sequences, one each (the rest to the last one), so a padded
        # sequence has 0 or 1 query tokens whatever the bucket.
        extra = t_pad - t
        for i in range(b, b_pad):
            total += 1 if extra > 0 else 0
            extra -= 1
            qsl[i + 1] = total
        if extra > 0 and b_pad > b:
            qsl[b_pad] += extra
        h["seq_lens"][:b] = layout.seq_lens
        h["seq_lens"][b:b_pad] = 0
        self._copy_tables(layout.block_tables)
        for i in range(b, b_pad):  # the mirror first: an interrupt between the two leaves it short, not stale
            self._table_rows[i] = []
        h["block_tables"][b:b_pad, :width] = 0
        dev, host = self._views(t_pad, b_pad, width)
        num_decode_tokens = sum(layout.query_lens[: layout.num_decodes])
        return AttentionMetadata(
            num_seqs=b,
            num_tokens=t,
            num_decodes=layout.num_decodes,
            num_decode_tokens=num_decode_tokens,
            max_query_len=max(layout.query_lens, default=0),
            max_seq_len=max(layout.seq_lens, default=0),
            block_size=self.block_size,
            slot_mapping=dev[0],
            query_start_loc=dev[1],
            seq_lens=dev[2],
            block_tables=dev[3],
            query_start_loc_cpu=host[1],
            seq_lens_cpu=host[2],
            block_tables_cpu=host[3],
            query_lens=list(layout.query_lens),
            host_seq_lens=list(layout.seq_lens),
        )

    def _views(
        self, t_pad: int, b_pad: int, width: int
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The step's device views of the buffers (slot mapping, query starts, lengths, tables) and their
        host mirrors (the same tensors on a CPU); on a device, the host views are copied to it first.
        The views of each shape are made once (a decode batch keeps its shape step after step)."""
        key = (t_pad, b_pad, width)
        views = self._view_cache.get(key)
        if views is None:
            sizes = {
                "slot_mapping": t_pad,
                "query_start_loc": b_pad + 1,
                "seq_lens": b_pad,
                "block_tables": b_pad,
            }

            def cut(buffers: dict[str, torch.Tensor], name: str) -> torch.Tensor:
                view = buffers[name][: sizes[name]]
                return view[:, :width] if name == "block_tables" else view

            host = tuple(cut(self.host, name) for name in sizes)
            dev = host if self.dev is self.host else tuple(cut(self.dev, name) for name in sizes)
            if len(self._view_cache) >= 256:  # shapes of prefill steps vary: keep the cache small
                self._view_cache.clear()
            views = self._view_cache[key] = (dev, host)
        dev, host = views
        if dev is not host:
            for dst, src in zip(dev, host):
                dst.copy_(src, non_blocking=True)
        return dev, host

    def _copy_tables(self, block_tables: list[list[int]]) -> None:
        """Copy each step's block tables into the host buffer, row by row, only what changed since the
        last step: a running sequence's table mostly just grew, and converting a whole table from Python
        ints is the step's largest host cost at long contexts (128 x 256 blocks: about 1.6 ms here).
        Each row is compared, by value, with a copy of what the buffer row holds (`_table_rows`): a table
        changed in place (copy on write, blocks given back) or another sequence in that row is written
        whole. The mirror never claims more than the buffer holds: a row's mirror is emptied before the
        row is rewritten and extended only after its new entries are written."""
        tables = self._host_arrays["block_tables"]
        for i, row in enumerate(block_tables):
            held = self._table_rows[i]
            n = len(held)
            if len(row) >= n and (row[:n] == held if len(row) > n else row == held):
                if len(row) > n:
                    tables[i, n : len(row)] = row[n:]
                    held.extend(row[n:])
            else:
                self._table_rows[i] = []  # first: an interrupt before the copy leaves the mirror short
                tables[i, : len(row)] = row
                self._table_rows[i] = list(row)

    def write_slots(self, common: AttentionMetadata) -> torch.Tensor:
        """`slot_mapping` with padded tokens (``-1``) sent to the scratch block, in a persistent buffer (a
        fixed address for CUDA graphs): what a fixed-shape ``index_copy_`` store writes to."""
        padded = common.num_padded_tokens > common.num_tokens
        if self._write_slots is None:
            if padded:
                raise ValueError("a padded step needs the scratch block (num_blocks given to make_builder)")
            return common.slot_mapping  # already a view of a persistent buffer
        slots = self._write_slots[: common.num_padded_tokens]
        slots.copy_(common.slot_mapping)
        if padded:
            slots.masked_fill_(slots < 0, self.scratch_block * self.block_size)
        return slots

    def build(
        self, layout: StepLayout, num_padded_seqs: int | None = None, num_padded_tokens: int | None = None
    ) -> AttentionMetadata:
        """The backend's metadata for this step (the common metadata unless a backend adds to it)."""
        return self.build_common(layout, num_padded_seqs, num_padded_tokens)


class AttentionBackend(ABC):
    """A paged-attention implementation. Tensors use the packed layout ``[T, heads, head_dim]``."""

    name: ClassVar[str]
    capabilities: ClassVar[BackendCapabilities]
    builder_class: ClassVar[type[MetadataBuilder]] = MetadataBuilder
    # Padded tokens go to one extra block past the usable ones (a fixed-shape store needs somewhere to
    # write them); a backend whose store kernel skips slot -1 needs none.
    uses_scratch_block: ClassVar[bool] = False

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
        """Why this backend cannot serve a model on `device` in `dtype` with `head_dim` (None: it can)."""
        caps = cls.capabilities
        if device.type not in caps.devices:
            return f"it runs on {sorted(caps.devices)}, not {device.type}"
        if dtype not in caps.dtypes:
            names = sorted(str(d).removeprefix("torch.") for d in caps.dtypes)
            return f"KV dtype {str(dtype).removeprefix('torch.')} is not supported (supported: {names})"
        if caps.head_dims is not None and head_dim not in caps.head_dims:
            return f"head_dim {head_dim} is not supported (supported: {sorted(caps.head_dims)})"
        return None

    def kv_cache_shape(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> tuple:
        """Shape of one layer's K (and of its V) cache of `dtype` for `num_blocks` usable blocks (plus the
        scratch block, for backends that use one); an int8 cache's rows hold their scales too
        (`kv_quant.row_width`, aligned as the backend asks)."""
        width = kv_quant.row_width(head_dim, dtype, self.capabilities.quantized_row_align)
        return (num_blocks + int(self.uses_scratch_block), block_size, num_kv_heads, width)

    def make_builder(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        num_blocks: int | None = None,
    ) -> MetadataBuilder:
        """The metadata builder for one engine (made once; it owns the step buffers). `num_blocks` is
        the number of usable blocks of the cache (the scratch block's index, for backends that use one)."""
        scratch = num_blocks if self.uses_scratch_block else None
        return self.builder_class(
            max_num_seqs, max_num_tokens, max_blocks_per_seq, block_size, device, scratch_block=scratch
        )

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        chunk: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's ``key``/``value`` ``[T, Hkv, D]`` in `kv_cache` at ``meta.slot_mapping``, then
        return causal paged attention of ``query`` ``[T, Hq, D]`` over each sequence's context, as a new
        ``[T, Hq, D]`` tensor (padded rows: any finite value). `window` > 0 (the layer's sliding window;
        only where ``capabilities.sliding_window``): a query at position p sees keys in
        ``(p - window, p]``; `chunk` > 0 (only where ``capabilities.chunked_attention``): keys in
        ``[p // chunk * chunk, p]``; `softcap` > 0 and `sinks` ``[Hq]`` likewise only where the
        capabilities say so."""

    def forward_heads_first(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        chunk: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """`forward` over transformers' head-first layout (``query`` ``[1, Hq, T, D]``, ``key``/``value``
        ``[1, Hkv, T, D]`` -> ``[1, T, Hq, D]``), for an eager step where the backend serves it without
        transposed copies; None where it does not (the caller takes `forward`). Default: never."""
        return None


def num_leading_decodes(query_lens: Sequence[int], decode_query_len: int) -> int:
    """How many leading sequences have at most `decode_query_len` query tokens (the decode path)."""
    count = 0
    for q in query_lens:
        if q > decode_query_len:
            break
        count += 1
    return count
