"""Several hosts: one engine whose mesh spans the devices of every host (`jax.distributed`).

Every host runs the same command; `jax.distributed.initialize` joins them, after which
`jax.devices()` lists every host's devices and the tensor-parallel mesh spans them. XLA's
SPMD programs need every process to launch the same computations in the same order with the
same inputs, so:

- rank 0 (the leader) owns the scheduler, the prefix cache and (serving) the HTTP server, and
  plans every step as with one host;
- before each device operation of its runner (block moves, persistent-batch updates, a
  step's forward, its sampler with the bitmask)
  it broadcasts what the operation needs (`StepChannel`: a header and an i32 payload, through
  JAX's own cross-process collective, `multihost_utils.broadcast_one_to_all`);
- every other rank (a follower) runs `ModelRunner.follow()`: it receives each operation and
  runs it on its devices, until the leader's STOP.

An abort on rank 0 is therefore an abort everywhere: the followers only ever run the steps
the leader planned. Start-up (loading, KV sizing, compiling) is the same code on every rank;
where a rank could differ (free GPU memory), rank 0's value is broadcast.
"""

import logging

import jax
import numpy as np

from jaxpaged.core.host_cache import HostMoves
from jaxpaged.runner.batch_builder import BatchShape, bucket_sizes, next_bucket
from jaxpaged.runner.block_ops import committed
from jaxpaged.runner.persistent_batch import apply_updates
from jaxpaged.runner.step import SAMPLER_KINDS

logger = logging.getLogger(__name__)

# OP_STEP: a forward (and, flagged, its unconstrained sampler); args: the BatchShape, whether the previous
# step's tokens go in, whether the sampler follows, the sampler kind the host picked (an index into
# step.SAMPLER_KINDS; -1: none), whether the step has prompt logprobs.
# OP_SAMPLE: a held-back sampler and its mask
# OP_TIER_STORE: one batch of the host tier's stores, gathered before the forward; args: its batch id
# OP_TIER_LOAD: the host tier's loads and drops after the forward, in pieces; args: (loads, drops, last):
# the last piece applies them all (and moves the plan's stores to host memory)
OP_STOP, OP_MOVE, OP_UPDATES, OP_STEP, OP_SAMPLE, OP_TIER_STORE, OP_TIER_LOAD = range(7)
HEADER_SIZE = 10
PAYLOAD_FLOOR = 256   # payloads are padded to a power of two at least this long (few broadcast shapes)


def initialize(coordinator: str | None, num_nodes: int, node_rank: int) -> None:
    """Join the hosts (no-op for one). Must run before JAX's first use of a device."""
    if num_nodes == 1:
        return
    if jax.distributed.is_initialized():
        if jax.process_count() != num_nodes or jax.process_index() != node_rank:
            raise ValueError(f"jax.distributed is already initialized as rank {jax.process_index()} of "
                             f"{jax.process_count()}, not node_rank {node_rank} of num_nodes {num_nodes}")
        return
    # XLA:CPU needs a cross-process collectives backend; GPUs bring NCCL
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_nodes, process_id=node_rank)
    logger.info("joined %d hosts as rank %d: %d devices in all, %d here", num_nodes, node_rank,
                jax.device_count(), jax.local_device_count())


def is_multihost() -> bool:
    return jax.process_count() > 1


def broadcast_value(value: int) -> int:
    """Rank 0's value of an int, on every rank."""
    if not is_multihost():
        return value
    from jax.experimental import multihost_utils
    return int(multihost_utils.broadcast_one_to_all(np.array([value], np.int64))[0])


class StepChannel:
    """Rank 0 sends each device operation of its runner; the other ranks receive them in order."""

    def __init__(self):
        self.is_leader = jax.process_index() == 0
        self.stopped = False

    def _broadcast(self, array: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.broadcast_one_to_all(array))

    def send(self, op: int, args: tuple[int, ...] = (), payload: np.ndarray | None = None) -> None:
        if not self.is_leader:
            raise RuntimeError("only rank 0 sends device operations")
        if self.stopped:
            raise RuntimeError("the other hosts were released (shutdown): this engine cannot run steps any more")
        if len(args) > HEADER_SIZE - 2:
            raise ValueError(f"at most {HEADER_SIZE - 2} header arguments, got {len(args)}")
        payload = np.zeros(0, np.int32) if payload is None else np.asarray(payload, np.int32).reshape(-1)
        header = np.zeros(HEADER_SIZE, np.int32)
        header[0] = op
        header[1:1 + len(args)] = args
        header[-1] = payload.size
        self._broadcast(header)
        if payload.size:
            padded = np.zeros(next_bucket(payload.size, PAYLOAD_FLOOR), np.int32)
            padded[:payload.size] = payload
            self._broadcast(padded)
        if op == OP_STOP:
            self.stopped = True

    def warm_up(self, max_payload: int) -> None:
        """Every rank, at the same point of start-up: compile the broadcasts of the header and of
        each payload bucket up to max_payload, so serving compiles none."""
        self._broadcast(np.zeros(HEADER_SIZE, np.int32))
        for size in bucket_sizes(PAYLOAD_FLOOR, next_bucket(max_payload, PAYLOAD_FLOOR)):
            self._broadcast(np.zeros(size, np.int32))

    def receive(self) -> tuple[int, tuple[int, ...], np.ndarray]:
        header = self._broadcast(np.zeros(HEADER_SIZE, np.int32))
        size = int(header[-1])
        payload = np.zeros(0, np.int32)
        if size:
            payload = self._broadcast(np.zeros(next_bucket(size, PAYLOAD_FLOOR), np.int32))[:size]
        return int(header[0]), tuple(int(x) for x in header[1:-1]), payload


def pairs_payload(*lists: list[tuple[int, int]]) -> np.ndarray:
    """Lists of (a, b) pairs as one flat i32 payload (their lengths travel in the header)."""
    flat = [x for pairs in lists for pair in pairs for x in pair]
    return np.asarray(flat, np.int32)


def split_pairs(payload: np.ndarray, *counts: int) -> list[list[tuple[int, int]]]:
    out, start = [], 0
    for n in counts:
        chunk = payload[start:start + 2 * n].reshape(-1, 2)
        out.append([(int(a), int(b)) for a, b in chunk])
        start += 2 * n
    return out


def tier_load_pieces(moves: HostMoves, size: int) -> list[tuple[tuple[int, int, int], np.ndarray]]:
    """A plan's host-tier loads (batch, slot, block) and drops as OP_TIER_LOAD (args, payload) pieces of
    at most `size` ints each; the last is flagged (and sent even when there is nothing to load)."""
    per_piece = max(1, size // 3)
    load_groups = [moves.loads[i:i + per_piece] for i in range(0, len(moves.loads), per_piece)]
    drop_groups = [moves.drops[i:i + size] for i in range(0, len(moves.drops), size)]
    pieces = ([([x for load in group for x in load], len(group), 0) for group in load_groups]
              + [(group, 0, len(group)) for group in drop_groups])
    pieces = pieces or [([], 0, 0)]
    return [((num_loads, num_drops, int(i == len(pieces) - 1)), np.asarray(flat, np.int32))
            for i, (flat, num_loads, num_drops) in enumerate(pieces)]


def read_tier_piece(args: tuple[int, ...], payload: np.ndarray) -> tuple[list, list, bool]:
    """One OP_TIER_LOAD piece: its loads (batch, slot, block), its drops, whether it is the last."""
    num_loads, num_drops, last = args[:3]
    loads = [tuple(row) for row in payload[:3 * num_loads].reshape(num_loads, 3).tolist()]
    return loads, payload[3 * num_loads:3 * num_loads + num_drops].tolist(), bool(last)


def follow(runner) -> int:
    """A follower rank's loop: run every device operation rank 0 sends to `runner` (a
    ModelRunner), in order, until it stops; returns the number of steps run."""
    if runner.channel is None or runner.channel.is_leader:
        raise RuntimeError("follow() runs on ranks other than 0 of a multi-host engine")
    last_tokens = runner._no_prev_tokens
    tier_loads, tier_drops = [], []
    while True:
        op, args, payload = runner.channel.receive()
        if op == OP_STOP:
            return runner.steps_run
        if op == OP_MOVE:
            runner._move_blocks(*split_pairs(payload, *args[:3]))
        elif op == OP_UPDATES:
            updates = [tuple(int(x) for x in row) for row in payload.reshape(args[0], 4)]
            runner.slot_state = apply_updates(runner.slot_state, updates, runner.plan)
        elif op == OP_STEP:
            shape = BatchShape(*args[:4])
            prev_tokens = last_tokens if args[4] else runner._no_prev_tokens
            _, sampler = runner._executables(shape, None if args[6] < 0 else SAMPLER_KINDS[args[6]])
            sample_rows, _, _ = runner.run_forward(shape, payload, prev_tokens, bool(args[7]))
            if args[5]:   # unconstrained: the sampler at once, everything allowed
                runner.slot_state, _, last_tokens = sampler(runner.state, runner.slot_state, sample_rows,
                                                            runner._bitmask_arg(shape, None), None)
        elif op == OP_SAMPLE:   # the held-back sampler of the last step run, with its mask
            bitmask = payload.reshape(shape.num_logits, runner.bitmask_words)
            runner.slot_state, _, last_tokens = sampler(runner.state, runner.slot_state, sample_rows,
                                                        runner._bitmask_arg(shape, bitmask), None)   # no processors
        elif op == OP_TIER_STORE:
            runner.host_cache.gather(committed(runner.kv_pool), HostMoves([(args[0], payload.tolist())], [], []))
        elif op == OP_TIER_LOAD:
            loads, drops, last = read_tier_piece(args, payload)
            tier_loads += loads
            tier_drops += drops
            if last:
                runner.follow_host_loads(HostMoves([], tier_loads, tier_drops))
                tier_loads, tier_drops = [], []
        else:
            raise RuntimeError(f"unknown operation {op} from rank 0")
