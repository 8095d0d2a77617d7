"""Vision-language checkpoints run as their language model alone (text in, text out; no vision tower)."""

import copy
from typing import Any


# A vision-language checkpoint runs its language model alone (text in, text out; no vision tower): its
# text_config is read as the *ForCausalLM of its model_type, and the loader reads the language model's
# tensors under either of their names (hf_names.hf_reader). Qwen's multimodal rope (mrope) is the plain rope
# on text: its three position streams are the same positions.
VISION_LANGUAGE_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                                 "LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                                 "LlavaOnevisionForConditionalGeneration",
                                 "Qwen2VLForConditionalGeneration",
                                 "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")
_TEXT_MODELS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen2_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl_text": "Qwen2ForCausalLM",
                "qwen3_vl_text": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def is_vision_language(hf_config: Any) -> bool:
    architectures = getattr(hf_config, "architectures", None) or []
    return bool(architectures) and architectures[0] in VISION_LANGUAGE_ARCHITECTURES


def language_model_config(hf_config: Any) -> Any:
    """A vision-language config's text_config (a copy) naming its *ForCausalLM, with the ids and embedding
    tying the top level gives (transformers ties a composite model's head by the top level's
    tie_word_embeddings); any other config as it is. ValueError for a language model we don't run."""
    if not is_vision_language(hf_config):
        return hf_config
    architectures = hf_config.architectures
    text = copy.deepcopy(hf_config.text_config)
    model_type = getattr(text, "model_type", None)
    if model_type not in _TEXT_MODELS:
        raise ValueError(f"{architectures[0]}'s language model {model_type!r} is not supported; supported: "
                         f"{', '.join(_TEXT_MODELS)}")
    text.architectures = [_TEXT_MODELS[model_type]]
    for name in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if getattr(hf_config, name, None) is not None:
            setattr(text, name, getattr(hf_config, name))
    return text
