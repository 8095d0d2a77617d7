"""What research code calls on an engine between generations (LLMEngine's mixin): weights
written in place, generation paused and resumed, sleep and wake, and LoRA adapters registered and
placed in device slots. Each runs on the engine's thread, between two steps."""

import functools

import jax
import numpy as np
from flax import nnx

from jaxpaged.lora.request import lora_cache_salt
from jaxpaged.outputs import RequestOutput


class ResearchMixin:
    # ---- research: weights in place, pause, sleep ------------------------------------------
    def update_weights(self, weights) -> list[RequestOutput]:
        """Write `weights` (a mapping or (name, array) pairs, Hugging Face names, any array type)
        into the model in place; partial updates are fine. Unless generation is paused, requests in
        flight first finish on the weights they started with (their outputs are returned). The
        prefix cache forgets every block computed before. Nothing recompiles. ValueError (nothing
        written) for an unknown, misshapen, non-float or quantized parameter."""
        from jaxpaged.models.weight_update import apply_updates, update_targets
        if self.runner.is_sleeping:
            raise ValueError("update_weights: the engine is sleeping; call wake_up() first")
        outputs = []
        while self.has_unfinished_requests() and not self.paused:
            outputs += self.step()
        if self._weight_targets is None:
            from jaxpaged.models.config import model_config_from_hf
            stacked = any(path[0] == "layers" and isinstance(path[1], str)
                          for path, _ in nnx.to_flat_state(self.runner.state))
            self._weight_targets = update_targets(model_config_from_hf(self.loaded.hf_config), stacked,
                                                  self.runner.plan.size)
        apply_updates(self.runner.state, self._weight_targets, weights, self.model_config.tie_word_embeddings)
        self.kv_cache.reset_prefix_cache(new_weights=True)
        return outputs

    def apply_model(self, func):
        """func(model) (vLLM's apply_model): the model a Flax NNX module over this engine's weights, on its
        devices; returns func's result. func may write weights in place (`model.embed.set_value(...)`) with
        their shapes and dtypes: they are placed as the old ones were and the prefix cache forgets what
        was computed before (as update_weights); nothing recompiles. A weight given another shape or
        dtype is a ValueError naming it, and no change is kept. ValueError while the engine sleeps."""
        if self.runner.is_sleeping:
            raise ValueError("apply_model: the engine is sleeping; call wake_up() first")
        before = [(path, v, v.get_value()) for path, v in nnx.to_flat_state(self.runner.state)]
        result = func(nnx.merge(self.runner.graphdef, self.runner.state))
        changed = [(path, v, old) for path, v, old in before if v.get_value() is not old]
        for path, v, old in changed:
            new = v.get_value()
            kinds = [jax.tree.map(lambda a: (tuple(np.shape(a)), np.dtype(a.dtype).name), x) for x in (old, new)]
            if jax.tree.structure(old) != jax.tree.structure(new) or kinds[0] != kinds[1]:
                for _, w, value in changed:
                    w.set_value(value)
                raise ValueError(f"apply_model changed weight {'.'.join(map(str, path))} from {kinds[0]} to "
                                 f"{kinds[1]}; weights keep their shapes and dtypes (no change was kept)")
        for _, v, old in changed:   # on the devices and in the sharding the compiled step was built for
            v.set_value(jax.tree.map(lambda n, o: jax.device_put(n, o.sharding), v.get_value(), old))
        if changed:
            self.kv_cache.reset_prefix_cache(new_weights=True)
        return result

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None):
        """vLLM's collective_rpc on this engine's one worker, its ModelRunner: `method` a name of one of its
        methods, or a function called as method(runner, *args, **kwargs); returns the result."""
        if isinstance(method, str):
            fn = getattr(self.runner, method, None)
            if method.startswith("_") or not callable(fn):
                raise ValueError(f"collective_rpc: the model runner has no public method {method!r}")
        elif callable(method):
            fn = functools.partial(method, self.runner)
        else:
            raise ValueError(f"collective_rpc's method must be a method name or a callable, got {method!r}")
        return fn(*args, **(kwargs or {}))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no request holds."""
        self.kv_cache.reset_prefix_cache()

    def pause_generation(self) -> list[RequestOutput]:
        """Stop running steps (step() returns nothing) until resume_generation(); requests stay
        queued with their blocks. Returns the outputs of the steps that were in flight."""
        outputs = []
        while self._in_flight:
            outputs += self._complete()
        self.paused = True
        return outputs

    def resume_generation(self) -> None:
        self.paused = False

    def sleep(self, level: int = 1) -> None:
        """Release device memory: the KV pool is dropped and the weights move to host memory (level 1)
        or are dropped (level 2: update_weights after wake_up). ValueError with requests unfinished."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.has_unfinished_requests():
            raise ValueError(f"sleep: {self.get_num_unfinished_requests()} request(s) are unfinished; "
                             "let them finish or abort them first")
        if self.runner.is_sleeping:
            return
        self.kv_cache.reset_prefix_cache(new_weights=level == 2)   # the pool's K/V is gone
        for runner in self._runners():
            runner.sleep(level)

    def wake_up(self) -> None:
        """Undo sleep(): the weights back on the device (after level 2: zeros, to be updated) and an
        empty KV pool."""
        for runner in self._runners():
            if runner.is_sleeping:
                runner.wake_up()
        if self.lora is not None:
            self.lora.forget_slots()   # after level 2 the slots are zeros; after level 1 rewriting is cheap

    def is_sleeping(self) -> bool:
        return self.runner.is_sleeping

    def _runners(self) -> list:
        drafter = self.speculator.drafter if self.speculator is not None else None
        return [self.runner] + ([drafter.runner] if drafter is not None else [])

    def _add_lora(self, lora_request, cache_salt: str | None) -> str | None:
        """Check and read a request's adapter; returns the prefix-cache salt its blocks go under
        (each adapter's K/V differs from the base model's and from every other adapter's)."""
        if lora_request is None:
            return cache_salt
        if self.lora is None:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        self.lora.add(lora_request, pinned=self._loras_in_use())
        return lora_cache_salt(cache_salt, lora_request)

    def _loras_in_use(self) -> set[int]:
        return {r.lora_int_id for r in self.scheduler.requests.values() if r.lora_int_id}   # (forks: their parent)

    def assign_loras(self, plan) -> None:
        """Before a step: every planned request's adapter in a device slot (request.lora_slot)."""
        if self.lora is None:
            return
        requests = [r for chunk in plan.chunks for r in (chunk.request, *chunk.forks)]
        self.lora.assign(requests, {r.lora_int_id for r in self.scheduler.running if r.lora_int_id})

    # ---- adapters (vLLM's add_lora / remove_lora / list_loras) --------------------------------
    def add_lora(self, lora_request) -> bool:
        """Register an adapter ahead of its requests (its folder is read now: ValueError if bad)."""
        if self.lora is None:
            raise ValueError("add_lora needs an engine started with enable_lora=True")
        self.lora.add(lora_request, pinned=self._loras_in_use())
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; requests running with it finish with it. False if unknown."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.lora.registered) if self.lora is not None else set()


class AsyncResearchMixin:
    """AsyncLLM's side of the same calls: coroutines run on the engine thread between two steps
    (through AsyncLLM.call), on every data-parallel replica."""

    async def _on_replicas(self, method: str, *args) -> list:
        """engine.method(*args) on every data-parallel replica, on the engine thread; their results."""
        return await self.call(lambda engine: [getattr(r, method)(*args) for r in engine.replicas()])

    async def update_weights(self, weights) -> None:
        """LLMEngine.update_weights on every replica (requests in flight finish on their weights first,
        unless paused; new requests wait meanwhile)."""
        await self._on_replicas("update_weights", weights if isinstance(weights, dict) else list(weights))

    async def reset_prefix_cache(self) -> None:
        await self._on_replicas("reset_prefix_cache")

    async def pause_generation(self) -> None:
        await self._on_replicas("pause_generation")

    async def resume_generation(self) -> None:
        await self._on_replicas("resume_generation")

    async def sleep(self, level: int = 1) -> None:
        await self._on_replicas("sleep", level)

    async def wake_up(self) -> None:
        await self._on_replicas("wake_up")

    async def is_sleeping(self) -> bool:
        return any(await self._on_replicas("is_sleeping"))

    async def add_lora(self, lora_request) -> bool:
        """Register an adapter (its folder is read now: ValueError if it cannot be used)."""
        return all(await self._on_replicas("add_lora", lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        return any(await self._on_replicas("remove_lora", lora_int_id))

    async def list_loras(self) -> set[int]:
        return set().union(*await self._on_replicas("list_loras"))

    async def start_profile(self) -> None:
        """Start a JAX profiler trace between two steps (profiler_config; engine/profiler.py)."""
        await self.call(lambda engine: engine.profiler.start())

    async def stop_profile(self) -> None:
        """Stop it between two steps; the trace is written to profiler_config's profiler_dir."""
        await self.call(lambda engine: engine.profiler.stop())
