"""Which adapters are on the device, in which slot (one engine's multi-LoRA state, on the host).

The model holds `max_loras` slots of stacked A/B weights (jaxpaged.lora.slots.lora_shapes). A
request's adapter is read from its folder when the request is added (a bad folder is a ValueError
then, never a failed step) and kept on the host; when the scheduler runs the request, the adapter
is written into a slot, unless it is in one already. A slot is reused only when no running
request uses its adapter (the scheduler runs at most max_loras adapters at once, so a slot is
always free or reusable). Writing a slot changes array values only: nothing recompiles.
"""

import collections
import functools

import jax
import numpy as np

from jaxpaged.lora.peft import HostAdapter, load_peft_adapter
from jaxpaged.lora.request import LoRARequest


@functools.partial(jax.jit, donate_argnums=0)
def _set_slot(stack, slot, values):
    """stack[:, slot] = values ([num_layers, ...]), in place."""
    return jax.lax.dynamic_update_index_in_dim(stack, values.astype(stack.dtype), slot, 1)


class LoRAManager:
    def __init__(self, state, cfg, max_loras: int, max_lora_rank: int, dtype, max_cpu_loras: int | None = None):
        self.state = state                    # the runner's nnx.State; its "lora" stacks are written in place
        self.cfg = cfg
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = np.dtype(dtype)
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.registered: dict[int, LoRARequest] = {}                          # add_lora / requests' adapters
        self._host: collections.OrderedDict[int, HostAdapter] = collections.OrderedDict()   # LRU, host copies
        self.slots: list[LoRARequest | None] = [None] * max_loras           # the adapter in each device slot
        self._last_used = [0] * max_loras
        self._clock = 0

    # ---- adapters known to the engine -------------------------------------------------------
    def add(self, lora: LoRARequest, pinned: set[int] = frozenset()) -> None:
        """Register the adapter and read its folder (ValueError if it cannot be used). An id
        already registered must name the same folder."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        known = self.registered.get(lora.lora_int_id)
        if known is not None and known.lora_path != lora.lora_path:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is already adapter {known.lora_name!r} "
                             f"({known.lora_path}); give each adapter its own id")
        self._host_copy(lora, pinned)
        self.registered[lora.lora_int_id] = lora

    def remove(self, lora_int_id: int) -> bool:
        """Forget the adapter (its slot is free for others; requests still running with it keep
        their slot until they finish). False if it was not registered."""
        if self.registered.pop(lora_int_id, None) is None:
            return False
        self._host.pop(lora_int_id, None)
        return True

    def _host_copy(self, lora: LoRARequest, pinned: set[int]) -> HostAdapter:
        adapter = self._host.get(lora.lora_int_id)
        if adapter is None:
            adapter = load_peft_adapter(lora.lora_path, self.cfg, self.max_lora_rank, self.dtype)
            self._host[lora.lora_int_id] = adapter
            while len(self._host) > self.max_cpu_loras:   # least recently used first, never one in use
                victim = next((i for i in self._host if i not in pinned and i != lora.lora_int_id), None)
                if victim is None:
                    break
                self._host.pop(victim)
        self._host.move_to_end(lora.lora_int_id)
        return adapter

    # ---- slots -------------------------------------------------------------------------------
    def assign(self, requests, in_use: set[int]) -> None:
        """Give each request (and its forks) its adapter's slot, writing adapters into slots as
        needed; `in_use`: the adapter ids of every running request (their slots stay)."""
        self._clock += 1
        for request in requests:
            lora = request.lora_request
            if lora is None:
                request.lora_slot = -1
                continue
            slot = self._slot_of(lora, in_use)
            self._last_used[slot] = self._clock
            request.lora_slot = slot

    def _slot_of(self, lora: LoRARequest, in_use: set[int]) -> int:
        for slot, held in enumerate(self.slots):   # the same id and folder (an id re-added elsewhere is new)
            if held is not None and (held.lora_int_id, held.lora_path) == (lora.lora_int_id, lora.lora_path):
                return slot
        free = [s for s, held in enumerate(self.slots) if held is None or held.lora_int_id not in in_use]
        if not free:
            raise RuntimeError(f"no LoRA slot for adapter {lora.lora_name!r}: {self.max_loras} in use "
                               "(the scheduler runs at most max_loras adapters at once)")
        slot = min(free, key=lambda s: (self.slots[s] is not None, self._last_used[s]))
        self._write(slot, self._host_copy(lora, in_use))
        self.slots[slot] = lora
        return slot

    def _write(self, slot: int, adapter: HostAdapter | None) -> None:
        """Write `adapter` into `slot` of every stack (zeros for the modules it leaves alone; all
        zeros for None)."""
        for name, variable in self.state["lora"].items():
            module, part = name.rsplit("_", 1)
            stack = variable.get_value()
            value = None if adapter is None else getattr(adapter, part).get(module)
            if value is None:
                value = np.zeros((stack.shape[0], *stack.shape[2:]), stack.dtype)
            variable.set_value(_set_slot(stack, np.int32(slot), jax.device_put(value, _replicated(stack))))

    def warm_up(self) -> None:
        """Compile the slot writes (slot 0 rewritten with zeros), so no adapter compiles when it loads."""
        self._write(0, None)
        self.slots[0] = None

    def forget_slots(self) -> None:
        """The device slots no longer hold what was written (the weights were dropped and restored):
        each adapter is written again when next scheduled."""
        self.slots = [None] * self.max_loras



def _replicated(array: jax.Array):
    sharding = array.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding
