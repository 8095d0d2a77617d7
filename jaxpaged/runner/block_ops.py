"""Whole-block moves on the KV pool: copy-on-write copies, swap out to / swap in from pinned host memory.

A block id names the same block in every layer, so each move is one gather and one
scatter over axis 2 of the pool ([layers, 2, blocks, kv_heads, block_size, head_dim]).
The number of blocks moved is padded to a power of two so each op compiles once per
bucket; padded entries scatter out of bounds and are dropped.

The host pool lives in `pinned_host` memory and is allocated once. Swap-out gathers on the
device and scatters into the (donated) host pool; swap-in gathers on the host (its indices
live in host memory too, as XLA requires) and scatters into the donated device pool.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxpaged.runner.batch_builder import next_bucket


def _padded(pairs: list[tuple[int, int]], src_pad: int, dst_pad: int) -> tuple[np.ndarray, np.ndarray]:
    size = next_bucket(len(pairs), 4)
    src = np.full(size, src_pad, np.int32)
    dst = np.full(size, dst_pad, np.int32)
    if pairs:
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
    return src, dst


@functools.partial(jax.jit, donate_argnums=(0,))
def _copy(kv_pool, src, dst):
    return kv_pool.at[:, :, dst].set(kv_pool[:, :, src], mode="drop")


def copy_blocks(kv_pool: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
    """kv_pool with block dst := block src for each (src, dst); pool donated."""
    src, dst = _padded(pairs, 0, kv_pool.shape[2])
    return _copy(kv_pool, src, dst)


class HostSwapSpace:
    """The pinned host pool and the two transfers between it and the device pool."""

    def __init__(self, kv_pool: jax.Array, num_host_blocks: int):
        device = next(iter(kv_pool.devices()))
        self.host_sharding = SingleDeviceSharding(device, memory_kind="pinned_host")
        shape = kv_pool.shape[:2] + (num_host_blocks + 1,) + kv_pool.shape[3:]
        self.num_host_blocks = num_host_blocks
        # placed with device_put inside the jit (not out_shardings) so the array's type carries the
        # host memory space, which later jits need to trace host-side gathers
        with jax.default_device(device):
            self.host_pool = jax.jit(lambda: jax.device_put(jnp.zeros(shape, kv_pool.dtype),
                                                            jax.memory.Space.Host))()
        self._swap_out = jax.jit(_swap_out, donate_argnums=(1,))
        self._swap_in = jax.jit(_swap_in, donate_argnums=(0,))

    def swap_out(self, kv_pool: jax.Array, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks ((device, host) pairs)."""
        src, dst = _padded(pairs, 0, self.host_pool.shape[2])
        self.host_pool = self._swap_out(kv_pool, self.host_pool, src, jax.device_put(dst, self.host_sharding))

    def swap_in(self, kv_pool: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
        """Copy host blocks back into device blocks ((host, device) pairs); returns the new pool."""
        src, dst = _padded(pairs, 0, kv_pool.shape[2])
        return self._swap_in(kv_pool, self.host_pool, jax.device_put(src, self.host_sharding), dst)


def _swap_out(kv_pool, host_pool, device_ids, host_ids):
    blocks = jax.device_put(kv_pool[:, :, device_ids], jax.memory.Space.Host)
    return host_pool.at[:, :, host_ids].set(blocks, mode="drop")


def _swap_in(kv_pool, host_pool, host_ids, device_ids):
    blocks = jax.device_put(host_pool[:, :, host_ids], jax.memory.Space.Device)
    return kv_pool.at[:, :, device_ids].set(blocks, mode="drop")
