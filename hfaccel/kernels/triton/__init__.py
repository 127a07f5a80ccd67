"""Triton paged-attention kernels on the NHD paged KV cache ``[num_blocks, block_size, Hkv, D]``.

- ``store_kv``: scatter a step's new K/V into the cache (slot ``-1`` writes nothing).
- ``paged_decode``: one query token per sequence, flash-decoding (split KV + LSE merge), CUDA-graph safe grid.
- ``paged_prefill``: packed multi-token (or mixed) steps, causal over the cached prefix and the new tokens.

Importing this package needs ``triton``; set ``TRITON_INTERPRET=1`` before importing it to run on CPU.
"""

from hfaccel.kernels.triton.decode import default_num_splits, paged_decode
from hfaccel.kernels.triton.prefill import paged_prefill
from hfaccel.kernels.triton.store import store_kv

__all__ = ["default_num_splits", "paged_decode", "paged_prefill", "store_kv"]
