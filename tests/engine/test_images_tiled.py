"""Images as grids of tiles: LLaVA-NeXT (the base tile and a grid at the best pinpoint, unpadded, a newline row
each) and LLaVA-OneVision (the grid downsized past anyres_max, a prompt of several images read as base tiles),
token for token and logprob for logprob against transformers (fp32, tiny random checkpoints)."""

import functools

from tests.engine.test_images import GREEDY, IMAGE_ID, TEXT, assert_matches, engine, image, tiny_vision_checkpoint

PINPOINTS = [[32, 64], [64, 32], [64, 64]]


@functools.cache
def llava_next() -> tuple[str, object]:
    """A tiny random LLaVA-NeXT checkpoint: a CLIP tower on 32 x 32 tiles, a grid of up to 2 x 2 of them."""
    import transformers
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    cfg = transformers.LlavaNextConfig(text_config={**TEXT, "model_type": "mistral", "sliding_window": None},
                                       vision_config=vision, image_token_index=IMAGE_ID, image_grid_pinpoints=PINPOINTS)
    processor = transformers.LlavaNextImageProcessorPil(size={"shortest_edge": 32}, image_grid_pinpoints=PINPOINTS,
                                                        crop_size={"height": 32, "width": 32})
    return tiny_vision_checkpoint(transformers.LlavaNextForConditionalGeneration, cfg, 8, "llava-next-", processor)


def test_llava_next_tiles_give_transformers_tokens_and_logprobs():
    """LLaVA-NeXT: an image's base tile and its grid (wide, tall and square images take different grids and
    counts of tokens, with the padding cut off and a newline row ending each row), as transformers' processor
    expands the prompt and its model generates."""
    import torch
    import transformers
    from jaxpaged import SamplingParams
    path, model = llava_next()
    processor = transformers.LlavaNextProcessor(transformers.AutoImageProcessor.from_pretrained(path, backend="pil"),
                                                transformers.AutoTokenizer.from_pretrained(path), patch_size=8,
                                                vision_feature_select_strategy="default", image_token="<image>",
                                                num_additional_image_tokens=1)
    llm = engine(path)
    text = "USER: <image>\nwhat is it? ASSISTANT:"
    for img in (image(12, (30, 70)), image(13, (90, 40)), image(14, (50, 50))):
        ref = processor(text=text, images=[img], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ref, do_sample=False, max_new_tokens=6, min_new_tokens=6, output_logits=True,
                                 return_dict_in_generate=True)
        n = ref["input_ids"].shape[1]
        tokens = out.sequences[0, n:].tolist()
        logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.logits, tokens)]
        got = llm.generate({"prompt": text, "multi_modal_data": {"image": img}}, SamplingParams(**GREEDY),
                           use_tqdm=False)[0]
        assert got.prompt_token_ids == ref["input_ids"][0].tolist()
        assert_matches(got, tokens, logprobs)
        images = llm.llm_engine.input_processor.images   # the server counts an image's tokens without the tower
        assert images.tower.num_rows(images.prepare(img, "image").size) == got.prompt_token_ids.count(IMAGE_ID)


@functools.cache
def llava_onevision() -> tuple[str, object]:
    """A tiny random LLaVA-OneVision checkpoint (a SigLIP tower, Qwen2): NeXT's grid of up to 3 x 3 tiles,
    downsized past 2 tiles' worth of features (anyres_max_2) to reach the bilinear path with small images."""
    import transformers
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=32, patch_size=8)
    pinpoints = [[32, 64], [64, 32], [64, 64], [96, 96], [32, 96]]
    cfg = transformers.LlavaOnevisionConfig(text_config={**TEXT, "model_type": "qwen2"}, vision_config=vision,
                                            image_token_index=IMAGE_ID, image_grid_pinpoints=pinpoints,
                                            vision_aspect_ratio="anyres_max_2", vision_feature_select_strategy="full",
                                            vision_feature_layer=-1)
    processor = transformers.LlavaOnevisionImageProcessorPil(size={"height": 32, "width": 32},
                                                             image_grid_pinpoints=pinpoints)
    return tiny_vision_checkpoint(transformers.LlavaOnevisionForConditionalGeneration, cfg, 9, "llava-onevision-",
                                  processor)


def test_llava_onevision_gives_transformers_tokens_and_logprobs():
    """LLaVA-OneVision: a lone image's grid (downsized when its features pass anyres_max), several images' base
    tiles only; transformers' model takes our expanded prompt (it refuses a count of image tokens that is not its
    features') with its image processor's pixels, and gives the same tokens and logprobs."""
    import torch
    import transformers
    from jaxpaged import SamplingParams
    path, model = llava_onevision()
    pixels = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    llm = engine(path)
    cases = [("USER: <image>\nwhat? ASSISTANT:", [image(30, (90, 95))]),   # 3 x 3 tiles: downsized
             ("USER: <image>\nwhat? ASSISTANT:", [image(31, (30, 70))]),   # 1 x 2: not
             ("<image><image> which?", [image(32, (40, 40)), image(33, (60, 20))])]
    counts = []
    for text, imgs in cases:
        got = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, SamplingParams(**GREEDY),
                           use_tqdm=False)[0]
        ids = got.prompt_token_ids
        counts.append(ids.count(IMAGE_ID))
        with torch.no_grad():
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones_like(torch.tensor([ids])),
                                 **pixels(images=[imgs], return_tensors="pt"), do_sample=False, max_new_tokens=6,
                                 min_new_tokens=6, output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(ids):].tolist()
        assert_matches(got, tokens, [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.logits, tokens)])
        inputs, alone = llm.llm_engine.input_processor.images, len(imgs) == 1   # the server's count, sans tower
        assert sum(inputs.tower.num_rows(inputs.prepare(i, "i", alone).size, alone) for i in imgs) == counts[-1]
    # 16 base rows, then 3 x 3 tiles' 12 x 11 features downsized to 5 x 5, each row ended by a newline (160
    # without); base tiles and a newline each
    assert counts[0] == 16 + 5 * (5 + 1) and counts[2] == 2 * (16 + 1)
