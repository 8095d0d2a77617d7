"""What the runner holds on the device, and giving it back: the KV pool, allocated at its first use
(after start-up's compilations: XLA's GPU autotuner needs memory while it compiles), its whole-block
moves (copy-on-write, swap to and from pinned host memory, the host tier's stores and loads), and
sleep mode (vLLM's `sleep` / `wake_up`), which drops the pool and moves or drops the weights.
ModelRunner inherits this; it reads the runner's `state`, `plan`, `kv_pool_spec`, `swap_space`,
`host_cache`, `channel` and `max_moved_blocks`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.core.sched_output import SchedulerOutput
from jaxpaged.parallel import POOL_SPEC
from jaxpaged.runner.block_ops import committed, copy_blocks, time_round_trip
from jaxpaged.runner.multihost import OP_MOVE, OP_TIER_LOAD, OP_TIER_STORE, pairs_payload, tier_load_pieces


class DeviceMemory:
    """The KV pool and sleep mode of ModelRunner (see the module docstring)."""

    _kv_pool = None
    _asleep = None   # the sleep level while asleep

    @property
    def kv_pool(self) -> jax.Array:
        """The paged KV pool, zeros when first used (see kv_pool_spec); None while asleep."""
        if self._kv_pool is None and not self.is_sleeping:
            spec = self.kv_pool_spec
            self._kv_pool = self.plan.zeros(spec.shape, spec.dtype, POOL_SPEC)
        return self._kv_pool

    @kv_pool.setter
    def kv_pool(self, value: jax.Array | None) -> None:
        self._kv_pool = value

    # ---- whole-block moves -----------------------------------------------------------------
    def block_bytes(self) -> int:
        """KV bytes of one block of the pool, every layer."""
        spec = self.kv_pool_spec
        return math.prod(spec.shape) // spec.shape[2] * spec.dtype.itemsize

    def measure_copy_rate(self) -> float | None:
        """Bytes per second, one way, between the pool and pinned host memory (preemption_mode="auto"):
        a round trip of the largest block move. None without swap space, or on several hosts (every
        host would have to join the transfers)."""
        if self.swap_space is None or self.channel is not None:
            return None
        self.kv_pool, seconds = time_round_trip(self.kv_pool, self.max_moved_blocks, self.swap_space)
        return 2 * self.max_moved_blocks * self.block_bytes() / seconds

    def load_host_blocks(self, plan: SchedulerOutput) -> None:
        """The host tier's loads, queued after the step's forward (their requests compute from the
        next step on: a load's copy overlaps this forward instead of holding it up), then its drops."""
        if plan.host is None:
            return
        if self.channel is not None:
            for args, payload in tier_load_pieces(plan.host, self.tier_payload):
                self.channel.send(OP_TIER_LOAD, args, payload)
        self.kv_pool = self.host_cache.load(committed(self.kv_pool), plan.host)

    def follow_host_loads(self, moves) -> None:
        """A follower rank: the leader's host-tier loads and drops. A load that fails here, but not on
        the leader, would leave this host's share of the blocks unlike the others': it stops the engine."""
        self.kv_pool = self.host_cache.load(committed(self.kv_pool), moves)
        blocks, _ = self.host_cache.take_failed()
        if blocks:
            raise RuntimeError(f"host tier: loading blocks {sorted(blocks)} failed on rank {jax.process_index()}")

    @property
    def tier_payload(self) -> int:
        """The longest OP_TIER_* payload (ints): a store batch's blocks, or a piece of the loads."""
        return 3 * self.max_moved_blocks

    def move_blocks(self, plan: SchedulerOutput) -> None:
        """The host tier's stores (gathered), swap-outs, swap-ins, then copy-on-write copies: all before
        the step reads the pool.

        Each runs in pieces of at most `max_moved_blocks`, so its compiled buckets are few
        (compiled at start-up) and its temporaries stay small."""
        if plan.host is not None and plan.host.stores:
            if self.channel is not None:
                for batch, blocks in plan.host.stores:
                    self.channel.send(OP_TIER_STORE, (batch,), np.asarray(blocks, np.int32))
            self.host_cache.gather(committed(self.kv_pool), plan.host)
        if not (plan.swap_out or plan.swap_in or plan.copies):
            return
        if self.channel is not None:
            self.channel.send(OP_MOVE, (len(plan.swap_out), len(plan.swap_in), len(plan.copies)),
                              pairs_payload(plan.swap_out, plan.swap_in, plan.copies))
        self._move_blocks(plan.swap_out, plan.swap_in, plan.copies)

    def _move_blocks(self, swap_out, swap_in, copies) -> None:
        n = self.max_moved_blocks
        self.kv_pool = committed(self.kv_pool)
        for i in range(0, len(swap_out), n):
            self.swap_space.swap_out(self.kv_pool, swap_out[i:i + n])
        for i in range(0, len(swap_in), n):
            self.kv_pool = self.swap_space.swap_in(self.kv_pool, swap_in[i:i + n])
        for i in range(0, len(copies), n):
            self.kv_pool = copy_blocks(self.kv_pool, copies[i:i + n])

    def sleep(self, level: int) -> None:
        """Give the device memory back: the KV pool is dropped; the weights move to pinned host
        memory (level 1) or are dropped too (level 2: the caller writes new ones after wake_up)."""
        if self._kv_pool is not None:
            self._kv_pool.delete()
        self._kv_pool = None
        self._asleep = level
        for _, variable in nnx.to_flat_state(self.state):
            def off(x):
                if level == 1:
                    host = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
                    host.block_until_ready()
                else:
                    host = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                x.delete()
                return host
            variable.set_value(jax.tree.map(off, variable.get_value()))

    def wake_up(self) -> None:
        """Undo sleep(): weights back on the device (zeros after level 2), an empty KV pool (taken at
        its first use); every array gets back the sharding the steps were compiled for."""
        for _, variable in nnx.to_flat_state(self.state):
            def on(x):
                device = x.sharding.with_memory_kind("device")
                if isinstance(x, jax.ShapeDtypeStruct):
                    return jax.jit(lambda: jnp.zeros(x.shape, x.dtype), out_shardings=device)()
                return jax.device_put(x, device)
            variable.set_value(jax.tree.map(on, variable.get_value()))
        self._asleep = None

    @property
    def is_sleeping(self) -> bool:
        return self._asleep is not None
