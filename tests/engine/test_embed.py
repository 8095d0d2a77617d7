"""runner="pooling" (vLLM's embeddings): LLM.embed against transformers' AutoModel on the same tiny
checkpoint, fp32 (the last token's final hidden state, L2-normalized), through chunked prefill, the
prefix cache and a batch of mixed lengths; the pooler's and the request's options; the errors."""

import functools
import json
import os
import shutil

import numpy as np
import pytest

from jaxpaged import LLM
from jaxpaged.pooling_params import PoolingParams
from tests.tiny_models import tiny_checkpoint

PROMPTS = [[5, 17, 42, 9, 100], list(range(3, 60)), [7], list(range(3, 60)) + [11, 12]]


@functools.cache
def embedder(**kwargs) -> LLM:
    # a 16-token budget: the 57- and 59-token prompts come in chunks; the 4th shares the 2nd's blocks
    return LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=128,
               max_num_batched_tokens=16, compile_on_startup=False, runner="pooling", **kwargs)


@functools.cache
def hf_base():
    import torch
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32).eval()


def hf_last_hidden(prompt: list[int]) -> np.ndarray:
    """transformers' final hidden state (after the model's last norm) of the prompt's last token."""
    import torch

    with torch.no_grad():
        return hf_base()(torch.tensor([prompt])).last_hidden_state[0, -1].numpy()


def unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_embeddings_match_transformers_through_chunks_and_the_prefix_cache():
    llm = embedder()
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.finished and out.prompt_token_ids == prompt and out.outputs.hidden_size == 64
        np.testing.assert_allclose(out.outputs.embedding, unit(hf_last_hidden(prompt)), atol=2e-6)
    again = llm.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)[0]   # its blocks cached now
    np.testing.assert_allclose(again.outputs.embedding, outs[1].outputs.embedding, atol=1e-6)
    metrics = llm.get_metrics()
    assert metrics["jaxpaged:prefix_cache_hits_total"] > 0 and metrics["jaxpaged:kv_cache_usage_perc"] == 0.0


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_match_transformers_through_chunks_and_preemption(kind):
    """MEAN: the mean of every prompt token's final hidden state; CLS: the first token's (sentence-transformers'
    mean_tokens and cls_token over transformers' last_hidden_state), whatever the chunks; the engine keeps no
    prefix cache (a cached token's hidden state is not computed), and a request recomputed after preemption
    is pooled from its first token again."""
    import torch

    llm = embedder(pooler_config=f'{{"pooling_type": "{kind}"}}')
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            states = hf_base()(torch.tensor([prompt])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(out.outputs.embedding, unit(states.mean(0) if kind == "MEAN" else states[0]),
                                   atol=2e-6)
    assert not llm.llm_engine.kv_cache.enable_caching
    tight = LLM(tiny_checkpoint("llama"), dtype="float32", block_size=8, num_gpu_blocks_override=10, max_model_len=72,
                max_num_batched_tokens=16, max_num_seqs=4, compile_on_startup=False, runner="pooling",
                preemption_mode="recompute", pooler_config={"pooling_type": kind})
    crowded = tight.embed([{"prompt_token_ids": PROMPTS[1]}] * 3, use_tqdm=False)   # 3 x 8 blocks of 9 usable
    assert tight.get_metrics()["jaxpaged:num_preemptions_total"] > 0
    for out in crowded:
        np.testing.assert_allclose(out.outputs.embedding, outs[1].outputs.embedding, atol=2e-6)


def test_encode_gives_arrays_and_the_requests_options_apply():
    llm = embedder()
    prompt = {"prompt_token_ids": PROMPTS[0]}
    raw = llm.encode(prompt, PoolingParams(normalize=False), use_tqdm=False)[0]
    assert isinstance(raw.outputs.data, np.ndarray) and raw.outputs.data.dtype == np.float32
    np.testing.assert_allclose(raw.outputs.data, hf_last_hidden(PROMPTS[0]), rtol=1e-5, atol=1e-5)
    cut = llm.embed({"prompt_token_ids": PROMPTS[1]}, truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert cut.prompt_token_ids == PROMPTS[1][-5:]
    np.testing.assert_allclose(cut.outputs.embedding, unit(hf_last_hidden(PROMPTS[1][-5:])), atol=2e-6)
    with pytest.raises(ValueError, match="dimensions=8: the model does not support Matryoshka"):
        llm.embed(prompt, pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="this engine runs runner='pooling'"):
        llm.generate(prompt, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_matryoshka_model_gives_fewer_dimensions(tmp_path):
    """dimensions: the first k values, normalized again (a config declaring is_matryoshka)."""
    folder = tmp_path / "matryoshka"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    llm = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64,
              compile_on_startup=False, runner="pooling")
    out = llm.embed({"prompt_token_ids": PROMPTS[0]}, pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    np.testing.assert_allclose(out[0].outputs.embedding, unit(hf_last_hidden(PROMPTS[0])[:8]), atol=2e-6)
    with pytest.raises(ValueError, match=r"dimensions=65 is more than the model's 64"):
        llm.embed({"prompt_token_ids": PROMPTS[0]}, pooling_params=PoolingParams(dimensions=65), use_tqdm=False)


def test_the_sentence_transformers_pooling_is_read_and_an_unbuilt_one_is_refused(tmp_path):
    from jaxpaged.pooling_params import PoolerConfig

    folder = tmp_path / "st"
    (folder / "1_Pooling").mkdir(parents=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True,
                                                                  "pooling_mode_mean_tokens": False}))
    assert PoolerConfig.of(None, str(folder)) == PoolerConfig("LAST", normalize=False)   # no Normalize module
    (folder / "modules.json").write_text(json.dumps(modules + [{"idx": 2, "name": "2", "path": "2_Normalize",
                                                                "type": "sentence_transformers.models.Normalize"}]))
    assert PoolerConfig.of(None, str(folder)) == PoolerConfig("LAST", normalize=True)
    for mode, kind in (("mean_tokens", "MEAN"), ("cls_token", "CLS")):
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{mode}": True}))
        assert PoolerConfig.of(None, str(folder)) == PoolerConfig(kind, normalize=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match=r"sentence-transformers pooling is \['max_tokens'\]"):
        PoolerConfig.of(None, str(folder))
    assert PoolerConfig.of('{"pooling_type": "last", "normalize": false}', str(folder)) == PoolerConfig("LAST", False)
    assert PoolerConfig.of({"pooling_type": "mean"}, None) == PoolerConfig("MEAN")
    with pytest.raises(ValueError, match="pooler_config.pooling_type must be one of LAST, MEAN, CLS, got 'MAX'"):
        PoolerConfig.of({"pooling_type": "MAX"}, None)
    assert PoolerConfig.of(None, os.fspath(tmp_path)) == PoolerConfig()   # no modules.json: LAST, normalized


def test_a_generating_engine_refuses_pooling_and_bad_arguments_are_named():
    from jaxpaged.engine.arg_utils import EngineArgs
    from tests.engine.test_llm_generate import tiny_llm

    with pytest.raises(ValueError, match="need a pooling model: make the LLM with runner='pooling'"):
        tiny_llm().embed([5, 6, 7], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params need an engine made with runner='pooling'"):
        tiny_llm().llm_engine.add_request("p", [5, 6, 7], pooling_params=PoolingParams())
    with pytest.raises(ValueError, match="runner must be one of 'auto', 'generate', 'pooling'"):
        EngineArgs(runner="embed")
    with pytest.raises(ValueError, match='pooler_config must be None with runner="generate"'):
        EngineArgs(runner="generate", pooler_config={"pooling_type": "LAST"})
    with pytest.raises(ValueError, match="normalize must be None, True or False"):
        PoolingParams(normalize=1)


def test_a_bare_transformer_checkpoint_embeds_by_default_and_cannot_generate(tmp_path):
    """A checkpoint of the model without its LM head (architectures ["LlamaModel"], tensors without the
    "model." prefix, as e5-mistral's MistralModel): runner "auto" pools it, "generate" is refused."""
    folder = tmp_path / "bare"
    hf_base().save_pretrained(folder)
    for name in os.listdir(tiny_checkpoint("llama")):   # its tokenizer and generation config
        if not name.endswith((".safetensors", ".json")) or name.startswith(("tokenizer", "special")):
            shutil.copy(os.path.join(tiny_checkpoint("llama"), name), folder / name)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaModel"]
    llm = LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64,
              compile_on_startup=False)
    assert llm.llm_engine.args.runner == "pooling"
    out = llm.embed({"prompt_token_ids": PROMPTS[0]}, use_tqdm=False)[0]
    np.testing.assert_allclose(out.outputs.embedding, unit(hf_last_hidden(PROMPTS[0])), atol=2e-6)
    with pytest.raises(ValueError, match="runner='generate' needs a model with an LM head; LlamaModel has none"):
        LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64,
            compile_on_startup=False, runner="generate")
    with pytest.raises(ValueError, match="speculative_config must be None with runner='pooling'"):
        LLM(str(folder), dtype="float32", block_size=8, num_gpu_blocks_override=32, max_model_len=64,
            compile_on_startup=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_score_is_the_cosine_of_the_embeddings_one_to_many_and_pairwise():
    llm = embedder()
    a, b, c = ({"prompt_token_ids": p} for p in PROMPTS[:3])
    want = [float(unit(hf_last_hidden(PROMPTS[0])) @ unit(hf_last_hidden(p))) for p in PROMPTS[1:3]]
    one_to_many = llm.score(a, [b, c], use_tqdm=False)
    assert [round(o.outputs.score, 5) for o in one_to_many] == [round(w, 5) for w in want]
    assert one_to_many[0].prompt_token_ids == PROMPTS[0] + PROMPTS[1]
    pairwise = llm.score([a, b], [b, c], use_tqdm=False)
    assert abs(pairwise[0].outputs.score - want[0]) < 1e-5
    assert abs(llm.score(a, a, use_tqdm=False)[0].outputs.score - 1.0) < 1e-6
    with pytest.raises(ValueError, match=r"data_1 \(2 prompts\) must be one prompt or as many as data_2 \(3\)"):
        llm.score([a, b], [a, b, c], use_tqdm=False)


def test_a_cohere_embedding_goes_through_its_mean_centred_final_norm():
    """The host's final norm is the model's: Cohere's LayerNorm, not an RMSNorm."""
    import torch
    from transformers import AutoModel

    path = tiny_checkpoint("cohere")
    llm = LLM(path, dtype="float32", block_size=8, num_gpu_blocks_override=16, max_model_len=64,
              compile_on_startup=False, runner="pooling")
    out = llm.encode({"prompt_token_ids": PROMPTS[0]}, PoolingParams(normalize=False), use_tqdm=False)[0]
    with torch.no_grad():
        ref = AutoModel.from_pretrained(path, dtype=torch.float32).eval()(torch.tensor([PROMPTS[0]]))
    np.testing.assert_allclose(out.outputs.data, ref.last_hidden_state[0, -1].numpy(), rtol=1e-5, atol=1e-5)
