"""What the runner holds on the device, and giving it back: the KV pool, allocated at its first use
(after start-up's compilations: XLA's GPU autotuner needs memory while it compiles), and sleep mode
(vLLM's `sleep` / `wake_up`), which drops the pool and moves or drops the weights. ModelRunner
inherits this; it reads the runner's `state`, `plan` and `kv_pool_spec`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.parallel import POOL_SPEC


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
