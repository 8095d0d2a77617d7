"""LoRA adapters over HTTP (--enable-lora, --lora-modules; vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter): a request's `model` picks its adapter and gets what LLM.generate gives
with it, /v1/models lists adapters with their parent, and mistakes are OpenAI errors."""

import httpx
import pytest

from jaxpaged import AsyncLLM, EngineArgs, LoRARequest
from jaxpaged.server import build_app, parse_lora_modules
from tests.engine.test_lora import ARCH, adapter, oracle
from tests.server.helpers import serving
from tests.tiny_models import tiny_checkpoint, tiny_tokenizer

PROMPT = [5, 17, 42, 9, 33]


@pytest.fixture(scope="module")
def url():
    args = EngineArgs(model=tiny_checkpoint(ARCH), dtype="float32", block_size=8, num_gpu_blocks_override=48,
                      max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, enable_lora=True, max_loras=2,
                      max_lora_rank=8)
    engine = AsyncLLM.from_engine_args(args, use_tqdm=False)
    try:
        with serving(build_app(engine, ["base"], lora_modules=[LoRARequest("first", 1, adapter(1))])) as (url,):
            yield url
    finally:
        engine.shutdown()


def completion(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True}, timeout=60)


def text(url: str, model: str) -> str:
    response = completion(url, model)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def expected(path: str | None) -> str:
    """What transformers (+ peft) generates, as text."""
    return tiny_tokenizer().decode(oracle(path, PROMPT)[0], skip_special_tokens=True)


def test_the_model_field_picks_the_adapter(url):
    assert text(url, "first") == expected(adapter(1))
    assert text(url, "base") == expected(None)
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert models["first"]["parent"] == "base" and models["first"]["root"] == adapter(1)
    assert models["base"]["parent"] is None


def test_adapters_load_and_unload_while_serving(url):
    load = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": adapter(2)})
    assert load.status_code == 200, load.text
    assert "second" in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
    assert text(url, "second") == expected(adapter(2))
    again = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "second", "lora_path": adapter(2)})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "second"}).status_code == 200
    gone = completion(url, "second")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    missing = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "second"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "lora_name"


def test_a_bad_adapter_folder_is_a_400_and_serving_goes_on(url):
    bad = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/no/such/folder"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert "adapter_config.json" in bad.json()["error"]["message"]
    no_name = httpx.post(url + "/v1/load_lora_adapter", json={"lora_path": adapter(2)})
    assert no_name.status_code == 400 and no_name.json()["error"]["param"] == "lora_name"
    assert "bad" not in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
    assert text(url, "first") == expected(adapter(1))


def test_lora_modules_are_parsed_by_name_or_json():
    mods = parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}'])
    assert [(m.lora_name, m.lora_int_id, m.lora_path) for m in mods] == [("a", 1, "/x"), ("b", 2, "/y")]
    for bad, words in (("a", "name=path"), ('{"name": "b"}', "'name' and 'path'")):
        with pytest.raises(ValueError, match=words):
            parse_lora_modules([bad])
    with pytest.raises(ValueError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])
