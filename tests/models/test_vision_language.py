"""Vision-language checkpoints run as their language model, text in and text out: Gemma 3 (4B and up),
Mistral Small 3.1 (Mistral3), LLaVA, Qwen2.5-VL and Qwen3-VL, each against transformers' own vision-language model
on text-only input (fp32, tiny random checkpoints with a tiny vision tower the engine never reads), under
transformers 5's tensor names and the earlier ones."""

import copy
import functools
import json
import os

import numpy as np
import pytest

from tests.models.test_llama_family import assert_close
from tests.models.test_quantization import forward_logits
from tests.tiny_models import _config, scratch_folder, tiny_tokenizer

TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


def vision_language_config(kind: str):
    import transformers
    if kind == "gemma3":   # the tiny Gemma 3 text model (sliding / global layers, two ropes) under a SigLIP tower
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      image_size=32, patch_size=8)
        return transformers.Gemma3Config(text_config=_config("gemma3").to_dict(), vision_config=vision,
                                         mm_tokens_per_image=4, image_token_index=300)
    if kind.startswith("mistral3"):   # "mistral3-untied": its own LM head, and no tie flag in its config
        vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=32, patch_size=8, head_dim=16)
        text = dict(TEXT, model_type="mistral", head_dim=32, sliding_window=None)
        return transformers.Mistral3Config(text_config=text, vision_config=vision, image_token_index=300,
                                           tie_word_embeddings=kind == "mistral3")
    if kind == "llava":
        vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, image_size=32, patch_size=8, projection_dim=32)
        return transformers.LlavaConfig(text_config=dict(TEXT, model_type="llama"), vision_config=vision,
                                        image_token_index=300)
    if kind == "qwen3_vl":   # Qwen3's q/k norms, an interleaved mrope (the plain rope on text)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                      deepstack_visual_indexes=[0])
        text = dict(TEXT, head_dim=16, rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                     "mrope_interleaved": True})
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=300,
                                          tie_word_embeddings=False)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                  window_size=16, fullatt_block_indexes=[0])
    text = dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, bos_token_id=1, eos_token_id=2,
                                         image_token_id=300, tie_word_embeddings=False)


@functools.cache
def checkpoint(kind: str) -> tuple[str, object]:
    """(path, transformers' model) of a tiny random vision-language checkpoint."""
    import torch
    import transformers
    cfg = vision_language_config(kind)
    cls = {"gemma3": "Gemma3", "mistral3": "Mistral3", "mistral3-untied": "Mistral3", "llava": "Llava",
           "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}[kind]
    torch.manual_seed(sum(map(ord, kind)))
    model = getattr(transformers, f"{cls}ForConditionalGeneration")(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.15 if p.ndim >= 2 else 1.0 + 0.1 * torch.randn_like(p))
    path = scratch_folder(f"{kind}-vl-")
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = tiny_tokenizer()
    if kind == "gemma3":   # the template in the processor's chat_template.json only, as Gemma 3's repos ship it
        template, tokenizer = tokenizer.chat_template, copy.copy(tokenizer)
        tokenizer.chat_template = None
        with open(os.path.join(path, "chat_template.json"), "w") as f:
            json.dump({"chat_template": template}, f)
    tokenizer.save_pretrained(path)
    if kind == "mistral3-untied":   # as Mistral Small 3.1's config.json: no tie flag (Mistral3Config's default ties)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config.pop("tie_word_embeddings", None)
        config["text_config"].pop("tie_word_embeddings", None)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return path, model


def earlier_names(path: str) -> str:
    """The same checkpoint as transformers 4 saved it: language_model.model.* and language_model.lm_head."""
    from safetensors.numpy import load_file, save_file
    out = scratch_folder("earlier-names-")
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            with open(os.path.join(path, name), "rb") as src, open(os.path.join(out, name), "wb") as dst:
                dst.write(src.read())
    tensors = load_file(os.path.join(path, "model.safetensors"))
    renamed = {("language_model." + k if k.startswith("lm_head.")
                else k.replace("model.language_model.", "language_model.model.")): np.ascontiguousarray(v)
               for k, v in tensors.items()}
    save_file(renamed, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("kind", ["gemma3", "mistral3", "mistral3-untied", "llava", "qwen2_5_vl", "qwen3_vl"])
def test_the_language_model_gives_transformers_logits_on_text(kind):
    import torch
    path, model = checkpoint(kind)
    tokens = np.random.default_rng(1).integers(3, 299, 40).tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([tokens])).logits[0].numpy()
    ours, loaded = forward_logits(path, tokens)
    assert_close(ours, ref)
    if kind == "llava":   # transformers 4's names read the same
        assert_close(forward_logits(earlier_names(path), tokens)[0], ref)


def test_the_engine_serves_a_vision_language_checkpoint_as_text():
    """Gemma 3's multimodal checkpoint generates from text prompts with transformers' greedy tokens and chats
    with the template of its processor's chat_template.json; a config names what it cannot run."""
    import torch
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.models.config import model_config_from_hf
    path, model = checkpoint("gemma3")
    prompt = np.random.default_rng(2).integers(3, 299, 12).tolist()
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, 12:]
    llm = LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64,
              compile_on_startup=False)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref.tolist()
    assert llm.get_tokenizer().chat_template == tiny_tokenizer().chat_template   # from chat_template.json
    cfg = vision_language_config("llava")
    cfg.architectures, cfg.text_config.model_type = ["LlavaForConditionalGeneration"], "phi"
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration's language model 'phi' is not supported"):
        model_config_from_hf(cfg)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Gemma3ForConditionalGeneration"]
