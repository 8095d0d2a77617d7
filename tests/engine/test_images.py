"""Images in prompts (LLaVA with a CLIP or SigLIP tower): greedy tokens and logprobs as transformers'
LlavaForConditionalGeneration gives them on the same pixels (fp32, tiny random checkpoints), through
LLM.generate's multi_modal_data and LLM.chat's image parts; the prefix cache tells images apart; bad images are
ValueErrors naming the field, and nothing is lost."""

import base64
import copy
import functools
import io
import json
import os

import numpy as np
import pytest

from tests.tiny_models import scratch_folder, tiny_tokenizer

IMAGE_ID = 320   # "<image>", added to the tiny tokenizer
TEXT = dict(model_type="llama", vocab_size=328, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
# a LLaVA-style template: an image part is its placeholder, in the message where it was sent
LIST_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
                 "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:"
                 "{% endif %}")


@functools.cache
def llava(tower: str = "clip", layer=-2, strategy: str = "default") -> tuple[str, object]:
    """(path, transformers' model) of a tiny random LLaVA checkpoint with its image processor (32 x 32 pixels)."""
    import transformers
    vision = dict(model_type=f"{tower}_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    cfg = transformers.LlavaConfig(text_config=TEXT, vision_config=vision, image_token_index=IMAGE_ID,
                                   vision_feature_layer=list(layer) if isinstance(layer, tuple) else layer,
                                   vision_feature_select_strategy=strategy)
    processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return tiny_vision_checkpoint(transformers.LlavaForConditionalGeneration, cfg, 7, f"llava-{tower}-", processor)


def tiny_vision_checkpoint(model_class, cfg, seed: int, prefix: str, processor, tokens=("<image>",),
                           template: str = LIST_TEMPLATE) -> tuple[str, object]:
    """(path, model): a random fp32 model of `cfg` saved with the tiny tokenizer (with the image `tokens`, from
    IMAGE_ID on, and a `template` that places images) and its image `processor`."""
    import torch
    torch.manual_seed(seed)
    model = model_class(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.15 if p.ndim >= 2 else 1.0 + 0.1 * torch.randn_like(p))
    path = scratch_folder(prefix)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = copy.deepcopy(tiny_tokenizer())   # (a shared, cached one)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    assert tokenizer.convert_tokens_to_ids(list(tokens)) == list(range(IMAGE_ID, IMAGE_ID + len(tokens)))
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    processor.save_pretrained(path)
    return path, model


def image(seed: int, size=(40, 48)):
    import PIL.Image
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def hf_greedy(model, path: str, token_ids: list[int], images: list, max_tokens: int):
    """transformers' greedy tokens and their logprobs for an expanded prompt and its images."""
    import torch
    from transformers import AutoImageProcessor
    pixels = AutoImageProcessor.from_pretrained(path, backend="pil")(images=images, return_tensors="np")
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([token_ids]), pixel_values=torch.tensor(pixels["pixel_values"]),
                             attention_mask=torch.ones(1, len(token_ids), dtype=torch.long), do_sample=False,
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, output_logits=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, len(token_ids):].tolist()
    # raw logits: min_new_tokens' processor masks EOS in the scores
    logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, logprobs


def engine(path: str, **kwargs):
    from jaxpaged import LLM
    return LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=256,
               compile_on_startup=False, **kwargs)


GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)


def expanded(path: str, text: str, per_image: int) -> list[int]:
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(path).encode(text)
    return [t for i in ids for t in ([i] * per_image if i == IMAGE_ID else [i])]


def assert_matches(out, ref_tokens, ref_logprobs):
    got = out.outputs[0]
    assert got.token_ids == ref_tokens
    lps = [lp[t].logprob for lp, t in zip(got.logprobs, got.token_ids)]
    np.testing.assert_allclose(lps, ref_logprobs, atol=2e-4)


@pytest.mark.parametrize("tower, layer, strategy", [("clip", -2, "default"), ("siglip", (-3, -1), "full")])
def test_generate_with_images_gives_transformers_tokens_and_logprobs(tower, layer, strategy):
    """One image and two, in LLM.generate's multi_modal_data; chunked prefill cutting through an image gives
    the same tokens."""
    from jaxpaged import SamplingParams
    path, model = llava(tower, layer, strategy)
    per_image = 16 + (tower == "clip") - (strategy == "default")
    llm = engine(path)
    one = "USER: <image>\nwhat is it? ASSISTANT:"
    two = "USER: <image> and <image>: which? ASSISTANT:"
    a, b = image(1), image(2, (64, 30))
    outs = llm.generate([{"prompt": one, "multi_modal_data": {"image": a}},
                         {"prompt": two, "multi_modal_data": {"image": [a, b]}}], SamplingParams(**GREEDY),
                        use_tqdm=False)
    for out, text, imgs in zip(outs, (one, two), ([a], [a, b])):
        ids = expanded(path, text, per_image)
        assert out.prompt_token_ids == ids   # placeholders expanded, as vLLM shows them
        assert_matches(out, *hf_greedy(model, path, ids, imgs, 6))
    given = llm.generate({"prompt_token_ids": outs[1].prompt_token_ids, "multi_modal_data": {"image": [a, b]}},
                         SamplingParams(**GREEDY), use_tqdm=False)[0]   # placeholders already expanded
    assert given.outputs[0].token_ids == outs[1].outputs[0].token_ids
    chunked = engine(path, max_num_batched_tokens=8, enable_prefix_caching=False)
    again = chunked.generate({"prompt": two, "multi_modal_data": {"image": [a, b]}}, SamplingParams(**GREEDY),
                             use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_prefix_cache_tells_images_apart_and_reuses_the_same_one():
    """The same prompt with another image is not served the first image's K/V; the same image is a cache hit."""
    from jaxpaged import SamplingParams
    path, model = llava()
    llm = engine(path)
    text = "USER: <image>\ndescribe the picture in words. ASSISTANT:"
    ids = expanded(path, text, 16)
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": image(3)}}, SamplingParams(**GREEDY),
                         use_tqdm=False)[0]
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": image(4)}}, SamplingParams(**GREEDY),
                         use_tqdm=False)[0]
    same = llm.generate({"prompt": text, "multi_modal_data": {"image": image(3)}}, SamplingParams(**GREEDY),
                        use_tqdm=False)[0]
    assert_matches(other, *hf_greedy(model, path, ids, [image(4)], 6))
    assert other.num_cached_tokens < 8   # the image's blocks differ from the first block on (it starts at 3)
    assert same.num_cached_tokens >= 16 and same.outputs[0].token_ids == first.outputs[0].token_ids
    text_only = llm.generate("USER: <image>", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert text_only.prompt_token_ids.count(IMAGE_ID) == 1   # no multi_modal_data: the token is text


def test_chat_with_image_parts_as_data_urls():
    """LLM.chat takes OpenAI's image_url parts (data URLs) and vLLM's image_pil: the template places the
    placeholder; a template that reads content as a string gets it before the text (vLLM's string format)."""
    from jaxpaged import SamplingParams
    path, model = llava()
    llm = engine(path)
    a = image(5)
    message = {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                            {"type": "image_url", "image_url": {"url": data_url(a)}}]}
    out = llm.chat([message], SamplingParams(**GREEDY), use_tqdm=False)[0]
    ids = expanded(path, "user: what is this?<image>\nassistant:", 16)
    assert out.prompt_token_ids == ids
    assert_matches(out, *hf_greedy(model, path, ids, [a], 6))
    pil = {"role": "user", "content": [{"type": "image_pil", "image_pil": a}, {"type": "text", "text": "what?"}]}
    plain = llm.chat([pil], SamplingParams(**GREEDY), use_tqdm=False,
                     chat_template=tiny_tokenizer().chat_template)[0]   # {{ m['content'] }}: a string only
    assert plain.prompt_token_ids == expanded(path, "user: <image>\nwhat?\nassistant:", 16)


def test_bad_images_are_value_errors_naming_the_field_and_lose_nothing():
    from jaxpaged import LLM, SamplingParams
    path, _ = llava()
    llm = engine(path)
    text = "USER: <image>\nwhat? ASSISTANT:"
    cases = [({"image": "data:image/png;base64,!!"}, r"multi_modal_data\['image'\]\[0\].*base64"),
             ({"image": "data:image/png;base64," + base64.b64encode(b"not a png").decode()}, "not an image"),
             ({"image": np.zeros((4, 4), np.float32)}, r"uint8 \[height, width, 3 or 4\]"),
             ({"image": 7}, "must be a PIL image"),
             ({"video": image(1)}, r"allowed: \['image'\]"),
             ({"image": []}, "non-empty list"),
             ({"image": [image(1), image(2)]}, r"1 image token\(s\) \('<image>'\) for 2 image"),
             ({"image": "ftp://host/cat.png"}, "must start with data:image/ or http"),
             ({"image": "file:///etc/passwd"}, "file:// URLs need allowed_local_media_path")]
    for data, match in cases:
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt": text, "multi_modal_data": data}, use_tqdm=False)
    for ids in ([5, IMAGE_ID, IMAGE_ID, IMAGE_ID, 6], [5] + [IMAGE_ID] * 15 + [6, IMAGE_ID]):
        with pytest.raises(ValueError, match=f"{ids.count(IMAGE_ID)} image token"):
            llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image(1)}}, use_tqdm=False)
    with pytest.raises(ValueError, match="would cut into an image"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": image(1)}},
                     SamplingParams(truncate_prompt_tokens=20), use_tqdm=False)
    with pytest.raises(ValueError, match="taken by generation only"):
        llm.llm_engine.input_processor.tokenize({"prompt": text, "multi_modal_data": {"image": image(1)}})
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0, "blocks leaked"
    ok = llm.generate({"prompt": text, "multi_modal_data": {"image": image(1)}}, SamplingParams(max_tokens=2),
                      use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 2
    text_model = LLM(dtype="float32", max_model_len=64, compile_on_startup=False, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="multi_modal_data needs a vision-language model.*takes text only"):
        text_model.generate({"prompt": "hi", "multi_modal_data": {"image": image(1)}}, use_tqdm=False)


def test_async_llm_reads_and_processes_images_off_the_engine_thread():
    """AsyncLLM: the image's decoding and processing run in a worker thread; the engine's thread runs the tower
    alone, and the tokens are LLM.generate's. A bad image is still a ValueError before any output."""
    import asyncio
    import threading
    from jaxpaged import AsyncLLM, SamplingParams
    from jaxpaged.engine.arg_utils import EngineArgs
    from jaxpaged.engine.multimodal import PreparedImage
    path, _ = llava()
    llm = AsyncLLM.from_engine_args(EngineArgs(model=path, dtype="float32", block_size=8, num_gpu_blocks_override=64,
                                               max_model_len=256, compile_on_startup=False), use_tqdm=False)
    images, threads = llm.engine.input_processor.images, []
    prepare = images.prepare

    def spy(image, *args):
        if not isinstance(image, PreparedImage):   # (a prepared one is returned as it is)
            threads.append(threading.current_thread().name)
        return prepare(image, *args)
    images.prepare = spy
    prompt = {"prompt": "USER: <image>\nwhat? ASSISTANT:", "multi_modal_data": {"image": data_url(image(6))}}

    async def run(p):
        return [out async for out in llm.generate(p, SamplingParams(**GREEDY), output_kind="cumulative")][-1]
    try:
        got = asyncio.run(run(prompt))
        assert threads and "jaxpaged-engine" not in threads
        with pytest.raises(ValueError, match="not valid base64"):
            asyncio.run(run({**prompt, "multi_modal_data": {"image": "data:image/png;base64,!"}}))
    finally:
        llm.shutdown()
    ref = engine(path).generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids


def test_an_image_sent_again_does_not_run_the_tower_again():
    """The rows of recent images are kept (within CACHE_BYTES, the oldest dropped first)."""
    from jaxpaged import SamplingParams
    path, _ = llava()
    llm = engine(path, enable_prefix_caching=False)
    images = llm.llm_engine.input_processor.images
    runs = []
    tower_rows = images.tower.image_rows
    images.tower.image_rows = lambda *a: runs.append(1) or tower_rows(*a)

    def send(img):
        return llm.generate({"prompt": "<image> hi", "multi_modal_data": {"image": img}}, SamplingParams(**GREEDY),
                            use_tqdm=False)[0].outputs[0].token_ids
    first = send(image(20))
    assert send(image(20)) == first and len(runs) == 1
    images.CACHE_BYTES = 1   # room for the latest image's rows only
    send(image(21))
    assert send(image(20)) == first and len(runs) == 3


def test_file_urls_are_read_only_inside_allowed_local_media_path(tmp_path):
    """file:// image URLs (vLLM's allowed_local_media_path): read inside the folder, refused outside it (a
    `..` too) and without the argument."""
    from jaxpaged import SamplingParams
    path, _ = llava()
    media, outside = tmp_path / "media", tmp_path / "private"
    media.mkdir()
    outside.mkdir()
    image(16).save(media / "cat.png")
    image(16).save(outside / "cat.png")
    llm = engine(path, allowed_local_media_path=str(media))
    content = [{"type": "image_url", "image_url": {"url": f"file://{media}/cat.png"}}, {"type": "text", "text": "hi"}]
    got = llm.chat([{"role": "user", "content": content}], SamplingParams(**GREEDY), use_tqdm=False)[0]
    ref = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": image(16)}, content[1]]}],
                   SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    for url in (f"file://{outside}/cat.png", f"file://{media}/../private/cat.png"):
        with pytest.raises(ValueError, match="outside allowed_local_media_path"):
            llm.generate({"prompt": "<image>", "multi_modal_data": {"image": url}}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: file:// URLs need allowed_local_media_path"):
        engine(path).chat([{"role": "user", "content": content}], use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_local_media_path must be None or an existing folder"):
        engine(path, allowed_local_media_path=str(tmp_path / "none"))


def test_limit_mm_per_prompt_bounds_a_prompts_images():
    import argparse
    from jaxpaged.cli import add_engine_args, engine_kwargs
    from jaxpaged.engine.arg_utils import EngineArgs
    path, _ = llava()
    two = {"prompt": "<image> <image>", "multi_modal_data": {"image": [image(1), image(2)]}}
    with pytest.raises(ValueError, match="holds 2 images; this engine's limit_mm_per_prompt allows 1"):
        engine(path, limit_mm_per_prompt={"image": 1}).generate(two, use_tqdm=False)
    with pytest.raises(ValueError, match=r"limit_mm_per_prompt=\{'image': 0\} allows none"):
        engine(path, limit_mm_per_prompt='{"image": 0}').generate(two, use_tqdm=False)
    for bad in ({"video": 1}, {"image": -1}, "[1]"):
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            engine(path, limit_mm_per_prompt=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kwargs = engine_kwargs(parser.parse_args(["--limit-mm-per-prompt", '{"image": 3}']))
    assert EngineArgs(**kwargs).limit_mm_per_prompt == {"image": 3}


def test_a_checkpoint_without_an_image_processor_refuses_images():
    import shutil
    path, _ = llava()
    bare = scratch_folder("llava-bare-")
    for name in os.listdir(path):
        if name != "preprocessor_config.json":
            shutil.copy(os.path.join(path, name), bare)
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        engine(bare).generate({"prompt": "<image>", "multi_modal_data": {"image": image(1)}}, use_tqdm=False)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlavaForConditionalGeneration"]


def test_images_compile_nothing_after_startup():
    """The tower is compiled at start-up (one image shape); steps with image rows, chunked, beside text
    prompts run the start-up executables."""
    from jaxpaged import LLM, SamplingParams
    from tests.engine.test_no_compiles_after_startup import compilations
    path, _ = llava()
    llm = LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=48, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=32, use_tqdm=False)
    prompts = [{"prompt": "USER: <image>\nwhat? ASSISTANT:", "multi_modal_data": {"image": image(8)}},
               {"prompt": "<image><image> both", "multi_modal_data": {"image": [image(9), image(10, (20, 90))]}},
               "plain text beside them"]
    with compilations() as compiled:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert compiled == [], f"compiled after start-up: {compiled}"
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)


def test_image_embeddings_stand_for_their_images():
    """vLLM's image embeddings (enable_mm_embeds): transformers' get_image_features rows given as
    {"image_embeds": [images, tokens, hidden]} give the tokens and logprobs of the images themselves, and share
    nothing with them in the prefix cache; an engine without the flag, or rows of another width, refuse them."""
    import torch
    from transformers import AutoImageProcessor
    from jaxpaged import SamplingParams
    path, model = llava()
    a, b = image(1), image(2, (64, 30))
    two = "USER: <image> and <image>: which? ASSISTANT:"
    pixels = AutoImageProcessor.from_pretrained(path, backend="pil")(images=[a, b], return_tensors="pt")
    with torch.no_grad():
        rows = torch.stack(list(model.model.get_image_features(pixels["pixel_values"]).pooler_output))
    llm = engine(path, enable_mm_embeds=True)
    ref = llm.generate({"prompt": two, "multi_modal_data": {"image": [a, b]}}, SamplingParams(**GREEDY),
                       use_tqdm=False)[0]
    got = llm.generate({"prompt": two, "multi_modal_data": {"image": {"image_embeds": rows}}},
                       SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert got.prompt_token_ids == ref.prompt_token_ids and got.num_cached_tokens < 8
    bare = llm.generate({"prompt": two, "multi_modal_data": {"image": rows.numpy()}}, SamplingParams(**GREEDY),
                        use_tqdm=False)[0]   # the array alone, as vLLM takes LLaVA's
    assert bare.outputs[0].token_ids == got.outputs[0].token_ids
    assert bare.num_cached_tokens == len(got.prompt_token_ids) // 8 * 8   # the same rows: a cache hit
    assert_matches(got, ref.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(ref.outputs[0].logprobs,
                                                                                     ref.outputs[0].token_ids)])
    with pytest.raises(ValueError, match="image_embeds'\\] must have shape \\[tokens, hidden_size=64\\]"):
        llm.generate({"prompt": two, "multi_modal_data": {"image": {"image_embeds": rows[..., :8]}}}, use_tqdm=False)
    with pytest.raises(ValueError, match="enable_mm_embeds=True"):
        engine(path).generate({"prompt": two, "multi_modal_data": {"image": {"image_embeds": rows}}}, use_tqdm=False)
    assert llm.get_metrics()["jaxpaged:kv_cache_usage_perc"] == 0.0, "blocks leaked"
