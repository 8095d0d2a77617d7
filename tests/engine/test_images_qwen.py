"""Images in Qwen2-VL and Qwen2.5-VL prompts: greedy tokens and logprobs as transformers' generate gives them
on the same pixels (fp32, tiny random checkpoints), where the language model's rope turns each image token by
its row and column (M-RoPE) and the text after an image goes on from the image's longer side; prompt chunks
cutting through images, the prefix cache and LLM.chat give the same; nothing compiles after start-up."""

import functools

import numpy as np
import pytest

from tests.engine.test_images import GREEDY, IMAGE_ID, image, llava, tiny_vision_checkpoint

START, PAD, END = IMAGE_ID, IMAGE_ID + 1, IMAGE_ID + 2   # <|vision_start|> <|image_pad|> <|vision_end|>
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + PLACEHOLDER +
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@functools.cache
def qwen_vl(kind: str) -> tuple[str, object]:
    """(path, transformers' model) of a tiny random Qwen2-VL or Qwen2.5-VL checkpoint (images of 4 to 40 tokens;
    Qwen2.5-VL: windows of 2 x 2 tokens, its second layer sees the whole image)."""
    import transformers
    text = dict(vocab_size=328, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
                eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [2, 3, 3]})
    ids = dict(image_token_id=PAD, video_token_id=327, vision_start_token_id=START, vision_end_token_id=END)
    common = dict(depth=3, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if kind == "qwen2_vl":
        cfg = transformers.Qwen2VLConfig(text_config={"model_type": "qwen2_vl_text", **text}, vision_config=dict(
            embed_dim=32, mlp_ratio=2, hidden_size=64, **common), **ids)
        model_class = transformers.Qwen2VLForConditionalGeneration
    else:
        cfg = transformers.Qwen2_5_VLConfig(text_config={"model_type": "qwen2_5_vl_text", **text}, vision_config=dict(
            hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
            **common), **ids)
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    cfg.bos_token_id, cfg.eos_token_id = 1, 2
    processor = transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 40)
    return tiny_vision_checkpoint(model_class, cfg, 11, f"{kind}-", processor,
                                  ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"), TEMPLATE)


def grids(path: str, images: list, **kwargs) -> list[int]:
    from transformers import AutoImageProcessor
    out = AutoImageProcessor.from_pretrained(path, backend="pil", **kwargs)(images=images, return_tensors="np")
    return [int(np.prod(g)) // 4 for g in out["image_grid_thw"]]


def expanded(path: str, text: str, images: list, **kwargs) -> list[int]:
    """The prompt's token ids, each image's placeholder expanded (the image processor made with `kwargs`)."""
    from transformers import AutoTokenizer
    counts = iter(grids(path, images, **kwargs))
    return [t for i in AutoTokenizer.from_pretrained(path).encode(text)
            for t in ([i] * next(counts) if i == PAD else [i])]


def hf_greedy(model, path: str, token_ids: list[int], images: list, max_tokens: int, **kwargs):
    """transformers' greedy tokens and their logprobs for an expanded prompt and its images."""
    import torch
    from transformers import AutoImageProcessor
    pixels = AutoImageProcessor.from_pretrained(path, backend="pil", **kwargs)(images=images, return_tensors="np")
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=torch.tensor(pixels["pixel_values"]),
                             image_grid_thw=torch.tensor(pixels["image_grid_thw"]),
                             mm_token_type_ids=(ids == PAD).to(torch.int32), attention_mask=torch.ones_like(ids),
                             do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(token_ids):].tolist()
    logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, logprobs


def engine(path: str, **kwargs):
    from jaxpaged import LLM
    return LLM(path, **{**dict(dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=256,
                               compile_on_startup=False), **kwargs})


def assert_matches(out, ref_tokens, ref_logprobs):
    got = out.outputs[0]
    assert got.token_ids == ref_tokens
    np.testing.assert_allclose([lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)], ref_logprobs,
                               atol=2e-4)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_images_give_transformers_tokens_and_logprobs(kind):
    """One image, and two of other shapes with text between and after; chunks of 8 tokens through the images,
    the prefix cache's hit on the same prompt, and LLM.chat give the same tokens."""
    from jaxpaged import SamplingParams
    path, model = qwen_vl(kind)
    llm = engine(path)
    one = f"<|im_start|>user\n{PLACEHOLDER}what is it?<|im_start|>assistant\n"
    two = f"{PLACEHOLDER}and{PLACEHOLDER} which one is taller, and why?"
    a, b, c = image(1, (60, 90)), image(2, (150, 60)), image(3, (56, 56))
    prompts = [{"prompt": one, "multi_modal_data": {"image": a}},
               {"prompt": two, "multi_modal_data": {"image": [b, c]}}]
    outs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    for out, text, imgs in zip(outs, (one, two), ([a], [b, c])):
        ids = expanded(path, text, imgs)
        assert out.prompt_token_ids == ids
        assert_matches(out, *hf_greedy(model, path, ids, imgs, 6))
    again = llm.generate(prompts[1], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16 and again.outputs[0].token_ids == outs[1].outputs[0].token_ids
    chunked = engine(path, max_num_batched_tokens=8, enable_prefix_caching=False)
    got = chunked.generate(prompts[1], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == outs[1].outputs[0].token_ids
    content = [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "what is it?"}]
    chat = llm.chat([{"role": "user", "content": content}], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert chat.prompt_token_ids == outs[0].prompt_token_ids
    assert chat.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_qwen_vl_text_beside_images_and_preempted_images_keep_their_tokens():
    """Text-only prompts beside image prompts keep their own tokens; an image prompt preempted (recomputed
    after its blocks were taken) gives what it gives alone."""
    from jaxpaged import SamplingParams
    path, model = qwen_vl("qwen2_vl")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = engine(path)
    prompts = [{"prompt": f"{PLACEHOLDER}{PLACEHOLDER} tell", "multi_modal_data": {"image": [image(4), image(5)]}},
               "plain text, no image", {"prompt": f"look: {PLACEHOLDER}", "multi_modal_data": {"image": image(6)}}]
    refs = [alone.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    text_ref = engine(path, limit_mm_per_prompt={"image": 0}).generate(prompts[1], params, use_tqdm=False)[0]
    assert refs[1] == text_ref.outputs[0].token_ids
    tight = engine(path, num_gpu_blocks_override=9, max_model_len=64, enable_prefix_caching=False)
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert tight.get_metrics()["jaxpaged:num_preemptions_total"] > 0


def test_qwen_vl_images_compile_nothing_after_startup():
    """The tower's programs (one per patch-count bucket) and the steps' M-RoPE input are compiled at start-up."""
    from jaxpaged import LLM, SamplingParams
    from tests.engine.test_no_compiles_after_startup import compilations
    path, _ = qwen_vl("qwen2_5_vl")
    llm = LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=48, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, use_tqdm=False)
    prompts = [{"prompt": f"{PLACEHOLDER} what?", "multi_modal_data": {"image": image(8, (40, 40))}},
               {"prompt": f"{PLACEHOLDER}{PLACEHOLDER}",
                "multi_modal_data": {"image": [image(9), image(10, (150, 90))]}},
               "plain text beside them"]
    with compilations() as compiled:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert compiled == [], f"compiled after start-up: {compiled}"
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)


def test_mm_processor_kwargs_bound_the_pixels_and_the_towers_programs():
    """vLLM's mm_processor_kwargs reach the image processor (Qwen2-VL's max_pixels: fewer tokens for a large
    image, and fewer patch counts compiled for); --mm-processor-kwargs is its JSON; bad ones are ValueErrors."""
    import argparse
    from transformers import AutoImageProcessor
    from jaxpaged import SamplingParams
    from jaxpaged.cli import add_engine_args, engine_kwargs
    path, _ = qwen_vl("qwen2_vl")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--mm-processor-kwargs", '{"max_pixels": 6272}']))   # 28 x 28 x 8
    llm = engine(path, **kwargs)
    big = image(7, (200, 150))
    out = llm.generate({"prompt": f"{PLACEHOLDER} what?", "multi_modal_data": {"image": big}},
                       SamplingParams(max_tokens=2), use_tqdm=False)[0]
    small = AutoImageProcessor.from_pretrained(path, backend="pil", max_pixels=6272)(images=[big])["image_grid_thw"]
    assert out.prompt_token_ids.count(PAD) == int(np.prod(small[0])) // 4 <= 8
    assert llm.llm_engine.input_processor.images.tower.buckets == [32]
    with pytest.raises(ValueError, match="mm_processor_kwargs must be a JSON object"):
        engine(path, mm_processor_kwargs="max_pixels=3")


def test_a_prompts_mm_processor_kwargs_resize_its_own_images():
    """A prompt's mm_processor_kwargs (vLLM's, LLM.chat's too) reach the image processor for its images alone:
    transformers' tokens and logprobs for the image made smaller, the engine's size for the prompt beside it;
    kwargs that are not a dict, or an image larger than the engine compiled for, are ValueErrors that lose
    nothing."""
    from jaxpaged import SamplingParams
    path, model = qwen_vl("qwen2_vl")
    llm = engine(path)
    big, text, small = image(7, (200, 150)), f"{PLACEHOLDER} what?", {"max_pixels": 28 * 28 * 8}
    prompt = {"prompt": text, "multi_modal_data": {"image": big}}
    outs = llm.generate([{**prompt, "mm_processor_kwargs": small}, prompt], SamplingParams(**GREEDY), use_tqdm=False)
    ids = expanded(path, text, [big], **small)
    assert outs[0].prompt_token_ids == ids and outs[1].prompt_token_ids == expanded(path, text, [big])
    assert ids.count(PAD) < outs[1].prompt_token_ids.count(PAD)
    assert_matches(outs[0], *hf_greedy(model, path, ids, [big], 6, **small))
    content = [{"type": "image_pil", "image_pil": big}, {"type": "text", "text": "what?"}]
    chat = llm.chat([{"role": "user", "content": content}], SamplingParams(max_tokens=1), use_tqdm=False,
                    mm_processor_kwargs=small)[0]
    assert chat.prompt_token_ids.count(PAD) == ids.count(PAD)
    with pytest.raises(ValueError, match="mm_processor_kwargs must be a dict"):
        llm.generate({**prompt, "mm_processor_kwargs": "max_pixels=8"}, use_tqdm=False)
    with pytest.raises(ValueError, match="this vision tower takes up to"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": image(8, (600, 600))},
                      "mm_processor_kwargs": {"max_pixels": 28 * 28 * 400}}, use_tqdm=False)
    again = llm.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0, "blocks leaked"


def test_qwen_image_embeddings_with_their_grids_stand_for_their_images():
    """vLLM's Qwen2-VL image embeddings (enable_mm_embeds): {"image_embeds": [tokens, hidden], "image_grid_thw":
    [images, 3]} give transformers' tokens and logprobs of the images (the grids turn the rope); grids that do
    not add up to the rows are a ValueError."""
    import torch
    from transformers import AutoImageProcessor
    from jaxpaged import SamplingParams
    path, model = qwen_vl("qwen2_5_vl")
    text, imgs = f"{PLACEHOLDER}and{PLACEHOLDER} which?", [image(2, (150, 60)), image(3, (56, 56))]
    pixels = AutoImageProcessor.from_pretrained(path, backend="pil")(images=imgs, return_tensors="pt")
    with torch.no_grad():
        rows = torch.cat(list(model.model.get_image_features(pixels["pixel_values"],
                                                             pixels["image_grid_thw"]).pooler_output))
    llm = engine(path, enable_mm_embeds=True)
    embeds = {"image_embeds": rows, "image_grid_thw": pixels["image_grid_thw"]}
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": embeds}}, SamplingParams(**GREEDY),
                       use_tqdm=False)[0]
    ids = expanded(path, text, imgs)
    assert out.prompt_token_ids == ids
    assert_matches(out, *hf_greedy(model, path, ids, imgs, 6))
    with pytest.raises(ValueError, match="gives 7 rows"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": {**embeds, "image_grid_thw": [[1, 2, 14]]}}},
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"keys \['image_embeds', 'image_grid_thw'\]"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": {"image_embeds": rows}}}, use_tqdm=False)
    # chat's image_embeds parts, one per image, as the server takes them: base64 of torch.save, the grid's ints too
    from tests.server.test_images_server import torch_b64
    ends = np.cumsum([int(g.prod()) // 4 for g in pixels["image_grid_thw"]])
    parts = [{"type": "image_embeds", "image_embeds": {"image_embeds": torch_b64(rows[end - n:end]),
                                                       "image_grid_thw": torch_b64(grid[None])}}
             for end, n, grid in zip(ends, np.diff(ends, prepend=0), pixels["image_grid_thw"])]
    by_rows, by_image = (llm.chat([{"role": "user", "content": [*p, {"type": "text", "text": "which?"}]}],
                                  SamplingParams(**GREEDY), use_tqdm=False)[0]
                         for p in (parts, [{"type": "image", "image": i} for i in imgs]))
    assert by_rows.prompt_token_ids == by_image.prompt_token_ids
    assert by_rows.outputs[0].token_ids == by_image.outputs[0].token_ids


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl"])
def test_the_tower_gives_transformers_image_features_at_many_shapes(kind):
    """The tower alone against transformers' get_image_features: square, wide and tall images, grids whose
    token rows and columns fill Qwen2.5-VL's windows (of 2 x 2 tokens here) or leave them partial."""
    import jax
    import torch
    from transformers import AutoImageProcessor
    from jaxpaged.models.qwen_vision import QwenVisionTower
    from jaxpaged.models.safetensors_io import Checkpoint
    path, model = qwen_vl(kind)
    checkpoint = Checkpoint(path)
    processor = AutoImageProcessor.from_pretrained(path, backend="pil")
    tower = QwenVisionTower(model.config, checkpoint.get, checkpoint.__contains__, np.float32, jax.devices()[0])
    tower.fit_processor(processor)
    for size in [(56, 56), (112, 224), (300, 60), (60, 300), (170, 130)]:
        out = processor(images=[image(30, size)], return_tensors="np")
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        with torch.no_grad():
            ref = model.model.get_image_features(torch.tensor(out["pixel_values"]),
                                                 torch.tensor(out["image_grid_thw"])).pooler_output[0].numpy()
        np.testing.assert_allclose(tower.image_rows(out["pixel_values"], grid), ref, atol=1e-4, err_msg=str(grid))


@pytest.mark.parametrize("model", ["qwen2_5_vl", "llava"])
def test_the_kv_cache_leaves_the_towers_largest_program_its_memory(monkeypatch, model):
    """On a GPU (here CPU dressed as one), the tower is compiled before the KV cache is sized, and the cache
    leaves free what the tower's largest program needs beside its weights, as it does the largest step's
    (LLaVA's one tile program too)."""
    from jaxpaged import LLM
    from jaxpaged.engine import memory
    from jaxpaged.engine.memory import headroom_bytes
    from jaxpaged.runner.model_runner import ModelRunner
    from tests.engine.test_memory_sizing import MiB
    path, _ = llava() if model == "llava" else qwen_vl(model)
    seen = {}
    reserve = memory.step_reserve_bytes
    monkeypatch.setattr(memory, "has_device_memory", lambda device: True)
    monkeypatch.setattr(memory, "step_reserve_bytes", lambda runner: seen.setdefault("step", reserve(runner)))
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    total, in_use = 96 * MiB, 16 * MiB
    pool = int(0.9 * total)
    monkeypatch.setattr(memory, "driver_total_bytes", lambda device: total)
    monkeypatch.setattr(memory, "memory_stats", lambda device: {"bytes_in_use": in_use, "bytes_limit": pool,
                                                                 "largest_free_block_bytes": pool - in_use})
    llm = LLM(path, dtype="float32", block_size=8, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              gpu_memory_utilization=0.9)
    engine = llm.llm_engine
    tower = engine.input_processor.images.tower
    assert tower.reserve_bytes > 0
    per_block = ModelRunner.bytes_per_block(engine.model_config, 8, engine.loaded.dtype)
    assert engine.num_blocks == (pool - in_use - seen["step"] - tower.reserve_bytes - headroom_bytes(pool)) // per_block
