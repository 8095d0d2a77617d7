"""A checkpoint's generation_config.json, honoured as vLLM's `generation_config="auto"` does.

Model authors ship sampling defaults (Qwen2.5-Instruct: temperature 0.7, top_p 0.8, top_k 20,
repetition_penalty 1.05) and extra end-of-turn ids (Llama 3: `<|eot_id|>` beside
`<|end_of_text|>`). Its `eos_token_id` ends generation; its sampling fields fill in what a
request left unset, and a value the user set always wins. `generation_config="vllm"` ignores
the file (the engine's own defaults); a folder path reads the file from that folder instead.
"""

import dataclasses
import json
import logging
import os

from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field (the fields vLLM takes from the file)
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty"}


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = dataclasses.field(default_factory=dict)   # SamplingParams field -> default

    def apply(self, params: SamplingParams) -> SamplingParams:
        """`params` with each field the user did not set taken from the file; `params` itself is unchanged."""
        changes = {k: v for k, v in self.sampling.items() if not params.was_set(k)}
        if not changes:
            return params
        return dataclasses.replace(params, **changes)


def load_generation_defaults(mode: str, model_folder: str | None) -> GenerationDefaults:
    """Read the defaults for `generation_config` = "auto" (the model's folder), "vllm" (none) or a folder."""
    if mode == "vllm":
        return GenerationDefaults()
    folder = model_folder if mode == "auto" else mode
    if mode != "auto" and not os.path.isfile(os.path.join(folder, FILE_NAME)):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding {FILE_NAME}; "
                         f"no {FILE_NAME} in {folder!r}")
    path = os.path.join(folder, FILE_NAME) if folder and os.path.isdir(folder) else None
    if path is None or not os.path.isfile(path):
        return GenerationDefaults()
    with open(path) as f:
        raw = json.load(f)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None)
    sampling = {field: raw[key] for key, field in SAMPLING_FIELDS.items() if raw.get(key) is not None}
    try:   # the file's values must be valid sampling settings themselves
        SamplingParams(**sampling)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc} (pass generation_config='vllm' to ignore the file)") from None
    if sampling:
        logger.info("default sampling parameters from %s: %s (set a field to override it; "
                    "generation_config='vllm' ignores the file)", path, sampling)
    return GenerationDefaults(eos_ids, sampling)
