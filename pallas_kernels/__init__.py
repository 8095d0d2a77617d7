"""Attention kernels over the paged KV pool.

The pool layout is owned here (see `layout.py`); the engine deals only in block ids.
`reference` is plain jnp: the ground truth and the CPU path.
"""

from jaxpaged.kernels.layout import kv_pool_shape, write_kv
from jaxpaged.kernels.metadata import AttentionMetadata
from jaxpaged.kernels.reference import ragged_paged_attention_reference

__all__ = [
    "AttentionMetadata",
    "kv_pool_shape",
    "ragged_paged_attention_reference",
    "write_kv",
]
