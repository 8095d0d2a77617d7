"""Attention kernels over the paged KV pool.

The pool layout is owned here (see `layout.py`); the engine deals only in block ids.
`reference` is plain jnp: the ground truth and the CPU path.
"""

from pallas_kernels.layout import kv_pool_shape, write_kv
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.reference import ragged_paged_attention_reference

__all__ = [
    "AttentionMetadata",
    "kv_pool_shape",
    "ragged_paged_attention_reference",
    "write_kv",
]
