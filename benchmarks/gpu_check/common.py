"""What every part of the GPU check shares: the result row, the sizes, the context, timing.

Only the standard library at import time: the driver process imports this module and must
not touch a device (each part runs in its own child process, which owns the GPU while it runs).
"""

import dataclasses
import json
import statistics
import time
import traceback
from typing import Any, Callable

STATUSES = ("ok", "fail", "error", "skip", "timeout")


@dataclasses.dataclass
class Row:
    """One line of the result table.

    status: ok (ran, and passed where there is a pass criterion), fail (ran, missed the
    criterion), error (raised), skip (cannot run here, `note` says why), timeout (killed).
    """

    part: str
    case: str
    status: str
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)   # shown in the table
    note: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)      # JSON only (tokens, raw numbers)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")


def error_row(part: str, case: str, exc: BaseException) -> Row:
    """An `error` row naming the exception and where it was raised (the last frame in our code)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/jaxpaged/" in f.filename
              or "/pallas_kernels/" in f.filename]
    where = f" at {frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else ""
    message = " ".join(str(exc).split())
    return Row(part, case, "error", note=f"{type(exc).__name__}{where}: {message[:400]}",
               data={"traceback": traceback.format_exception(exc)[-20:]})


def guarded(part: str, case: str, run: Callable[[], Row]) -> Row:
    """run() or, if it raises, an error row: one case's failure never hides the next case."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 -- every failure becomes a table row
        return error_row(part, case, exc)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size the parts use: GPU (the real check) and DRY (the CPU dry run)."""

    copy_bytes: int                       # bytes of the array copied device to device
    timing_rounds: int                    # median over this many rounds
    timing_round_s: float                 # each round repeats the call for at least this long
    correctness_context: int              # longest KV context in the correctness batches
    correctness_seqs: tuple[int, int, int]  # decodes and prompt chunks of a mixed batch; decodes of a decode batch
    correctness_heads: tuple[tuple[int, int, int], ...]   # (q heads, kv heads, head_dim) per batch family
    correctness_dtypes: tuple[str, ...]
    attention_seqs: tuple[int, ...]       # decode timing: sequences per batch
    attention_contexts: tuple[int, ...]   # decode timing: tokens of context per sequence
    attention_heads: tuple[int, int, int]  # (q heads, kv heads, head_dim)
    swap_shape: tuple[int, int, int, int]  # pool (layers, kv heads, block_size, head_dim)
    swap_blocks: int                      # blocks moved each way (a power of two: no padding)
    model: dict[str, Any]                 # Qwen2Config arguments of the engine's random model
    engine_prompts: int
    engine_prompt_len: tuple[int, int]    # prompt lengths drawn from [lo, hi]
    engine_max_tokens: int
    engine_agree_tokens: int              # greedy tokens compared across backends
    engine_max_model_len: int
    engine_batched_tokens: int
    step_engine_args: dict[str, Any]      # LLM(model, **these) of the step part; {} = the default arguments
    step_workload_lens: tuple[int, ...]   # prompt lengths of the mixed workload counting compilations
    step_workload_tokens: int             # max_tokens of each of its requests
    step_decode_seqs: tuple[int, ...]     # sequences per timed decode batch
    step_prompt_len: int                  # prompt tokens of each of those sequences
    step_max_tokens: tuple[int, int]      # (short, long) runs: their difference is (long - short) decode steps
    qmm_rows: tuple[int, ...] = (1, 16, 256)   # quantized matmul timing: activation rows
    # its weights [K, N]: an 8B model's gate projection (224 column programs) and its down projection (64:
    # the Mosaic kernel splits K)
    qmm_shapes: tuple[tuple[int, int], ...] = ((4096, 14336), (14336, 4096))
    sampler_rows: tuple[int, ...] = (32, 256)     # sampler layouts: sample rows (decode sequences)
    sampler_shape: tuple[int, int] = (896, 151936)   # their LM head [hidden, vocab] (Qwen2.5-0.5B's)
    block_size: int = 16
    prefill_context: int = 4096           # prefill timing: one prompt of this many tokens, its causal attention
    tier_history: int = 4096              # the host tier part: a history reloaded against recomputed
    # the same-run peer: a ShareGPT-shaped workload, prompt lengths lognormal around a median
    peer_requests: int = 256
    peer_prompt_len: tuple[int, int, int] = (220, 16, 1024)   # median, shortest, longest
    peer_new_tokens: int = 256                                 # every request (ignore_eos), both engines
    peer_engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)   # LLM(model, **these); {}: defaults
    # transformers' ContinuousBatchingConfig(**these); {}: its defaults (the cache sized from free memory)
    peer_transformers_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the 8B part: Llama-3.1-8B's config (random weights drawn by the engine), decode at these sequence counts
    large_model: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(LLAMA31_8B))
    large_decode_seqs: tuple[int, ...] = (32,)
    # the vision part: Qwen2.5-VL-7B's tower, compiled up to this many pixels, timed
    # on square images of these sides (pixels)
    vision_model: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(QWEN25_VL_7B_VISION))
    vision_max_pixels: int = 1792 * 1792
    vision_sides: tuple[int, ...] = (448, 1036, 1792)


_QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                   num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                   max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

LLAMA31_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                  tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
                  hidden_act="silu", attention_bias=False, mlp_bias=False)

# Qwen2.5-VL-7B's vision_config (the rest: vision._hf_config)
QWEN25_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           window_size=112, fullatt_block_indexes=[7, 15, 23, 31])

GPU = Sizes(
    copy_bytes=2 << 30, timing_rounds=5, timing_round_s=0.05,
    correctness_context=3000, correctness_seqs=(8, 4, 24), correctness_heads=((32, 8, 128), (14, 2, 64)),
    correctness_dtypes=("bfloat16", "float32"),
    attention_seqs=(64, 256), attention_contexts=(1024, 4096, 8192), attention_heads=(32, 8, 128),
    swap_shape=(24, 2, 16, 64), swap_blocks=8192,
    model=_QWEN25_05B, engine_prompts=64, engine_prompt_len=(16, 64), engine_max_tokens=128,
    engine_agree_tokens=16, engine_max_model_len=512, engine_batched_tokens=4096,
    # defaults: 256 sequences, 2048 tokens a step (so 3000 is a chunked prompt), the model's max_model_len
    step_engine_args={}, step_workload_lens=(1, 7, 33, 100, 250, 700, 1500, 3000), step_workload_tokens=24,
    step_decode_seqs=(1, 32, 256), step_prompt_len=64, step_max_tokens=(16, 80),
)

DRY = Sizes(
    copy_bytes=8 << 20, timing_rounds=3, timing_round_s=0.005,
    correctness_context=40, correctness_seqs=(3, 2, 4), correctness_heads=((6, 1, 64),),
    correctness_dtypes=("bfloat16",),
    attention_seqs=(3,), attention_contexts=(40,), attention_heads=(4, 2, 64),
    swap_shape=(2, 2, 16, 16), swap_blocks=16,
    model=dict(_QWEN25_05B, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=512, max_position_embeddings=256, bos_token_id=1, eos_token_id=2),
    engine_prompts=3, engine_prompt_len=(4, 12), engine_max_tokens=5, engine_agree_tokens=4,
    engine_max_model_len=64, engine_batched_tokens=16,
    # 2 step variants instead of the defaults' 35: a 2-core CPU compiles each for ~10 s
    step_engine_args=dict(max_num_seqs=4, max_num_batched_tokens=16), step_workload_lens=(1, 5, 17, 40, 70),
    step_workload_tokens=6, step_decode_seqs=(1, 2, 4), step_prompt_len=8, step_max_tokens=(4, 20),
    qmm_rows=(1, 5), qmm_shapes=((256, 128),), prefill_context=48, tier_history=64, sampler_rows=(4,),
    sampler_shape=(64, 512),
    # as the step part's: few step variants to compile (12 -> 8 s)
    peer_requests=4, peer_prompt_len=(8, 3, 20), peer_new_tokens=4,
    peer_engine_args=dict(max_num_seqs=4, max_num_batched_tokens=16),
    # its defaults size the cache from the CPU's free memory: ~22 s of tensors filled, the dry run's longest part
    peer_transformers_args=dict(num_blocks=16, max_batch_tokens=64),
    large_model=dict(LLAMA31_8B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=256,
                     rope_scaling=dict(LLAMA31_8B["rope_scaling"], original_max_position_embeddings=128),
                     bos_token_id=1, eos_token_id=2),
    large_decode_seqs=(2,),
    vision_model=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, window_size=56,
                      fullatt_block_indexes=[1]),
    vision_max_pixels=112 * 112, vision_sides=(56, 112),
)


@dataclasses.dataclass
class Context:
    """What the driver hands each part (as JSON to its child process)."""

    dry_run: bool
    workdir: str                          # scratch folder shared by the parts (the random model lives here)
    previous: list[Row] = dataclasses.field(default_factory=list)   # rows of the parts already run
    jax_triton_path: str = ""             # folder put first on PYTHONPATH for jax-triton ('' = the environment's)

    @property
    def sizes(self) -> Sizes:
        return DRY if self.dry_run else GPU

    def rows_of(self, part: str) -> list[Row]:
        return [r for r in self.previous if r.part == part]

    def platform(self) -> str | None:
        """The platform the env part saw ('gpu', 'cpu'), None before it ran."""
        for row in self.rows_of("env"):
            if "platform" in row.data:
                return row.data["platform"]
        return None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Context":
        d = json.loads(text)
        d["previous"] = [Row(**r) for r in d["previous"]]
        return cls(**d)


def time_call(fn: Callable, *args, rounds: int, round_s: float) -> float:
    """Median seconds per call of fn(*args), after one compiling call.

    Calls are queued back to back and waited for once per round (JAX dispatch is
    asynchronous), so launch overhead overlaps the device work as it does in the engine.
    """
    import jax

    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = time.perf_counter() - start
    repeats = max(1, min(500, int(round_s / max(once, 1e-6))))
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / repeats)
    return statistics.median(per_call)
