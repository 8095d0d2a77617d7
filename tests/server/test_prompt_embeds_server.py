"""prompt_embeds over HTTP (vLLM's /v1/completions field, --enable-prompt-embeds): base64 of torch.save(tensor)
read without torch, answered as the same prompt's token ids are; mistakes are 400s naming the field."""

import base64
import io
import os
import pickle
import zipfile

import httpx
import numpy as np
import pytest

from jaxpaged import AsyncLLM
from jaxpaged.engine.prompt_embeds import decode_base64
from jaxpaged.server import build_app
from tests.engine.test_prompt_embeds import hf_rows
from tests.server.helpers import MODEL, serving
from tests.server.test_async_llm import tiny_engine_args

IDS = [5, 17, 42, 9, 33, 61, 7, 12, 90, 4, 18]


def torch_b64(array, dtype=None) -> str:
    import torch

    tensor = torch.tensor(array)
    buffer = io.BytesIO()
    torch.save(tensor if dtype is None else tensor.to(dtype), buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_torch_save_is_read_without_torch(dtype):
    import torch

    values = np.random.default_rng(0).normal(size=(5, 12)).astype(np.float32)
    tensor = getattr(torch, dtype)
    np.testing.assert_array_equal(decode_base64(torch_b64(values, tensor)).astype(np.float32),
                                  torch.tensor(values).to(tensor).float().numpy())
    strided = torch.tensor(values).t()   # a transposed view: strides other than row-major
    buffer = io.BytesIO()
    torch.save(strided, buffer)
    np.testing.assert_array_equal(decode_base64(base64.b64encode(buffer.getvalue()).decode()), values.T)


def test_npy_and_what_is_not_a_tensor():
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    buffer = io.BytesIO()
    np.save(buffer, values)
    np.testing.assert_array_equal(decode_base64(base64.b64encode(buffer.getvalue()).decode()), values)
    with pytest.raises(ValueError, match="base64"):
        decode_base64("not base64 at all!")
    with pytest.raises(ValueError, match="torch.save"):
        decode_base64(base64.b64encode(b"plain bytes").decode())
    # a pickle naming anything but a tensor's parts is refused, not run
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(os.getcwd))
    with pytest.raises(ValueError, match="not a tensor's part"):
        decode_base64(base64.b64encode(archive.getvalue()).decode())


@pytest.fixture(scope="module")
def urls():
    engines = [AsyncLLM.from_engine_args(tiny_engine_args(enable_prompt_embeds=flag), use_tqdm=False)
               for flag in (True, False)]
    try:
        with serving(*(build_app(engine, [MODEL]) for engine in engines)) as urls:
            yield urls
    finally:
        for engine in engines:
            engine.shutdown()


def post(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "max_tokens": 6, "temperature": 0,
                                                     "ignore_eos": True, **body}, timeout=60)


def test_completions_take_prompt_embeds(urls):
    rows = hf_rows("llama", IDS)
    by_ids = post(urls[0], prompt=IDS)
    both = post(urls[0], prompt_embeds=[torch_b64(rows)], prompt=[IDS, IDS[:4]], return_token_ids=True)
    assert by_ids.status_code == 200 and both.status_code == 200, both.text
    choices = both.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]   # the embeddings' choice first, as vLLM orders them
    assert choices[0]["text"] == choices[1]["text"] == by_ids.json()["choices"][0]["text"]
    assert choices[0]["prompt_token_ids"] is None and choices[1]["prompt_token_ids"] == IDS
    assert both.json()["usage"]["prompt_tokens"] == 2 * len(IDS) + 4
    cut = post(urls[0], prompt_embeds=torch_b64(rows), truncate_prompt_tokens=4)
    assert cut.json()["usage"]["prompt_tokens"] == 4
    assert cut.json()["choices"][0]["text"] == post(urls[0], prompt=IDS[-4:]).json()["choices"][0]["text"]


@pytest.mark.parametrize("server, body, param", [
    (1, {"prompt_embeds": "AAAA"}, "prompt_embeds"),                                 # flag off
    (0, {"prompt_embeds": "not base64!"}, "prompt_embeds"),
    (0, {"prompt_embeds": [], "prompt": "hi"}, "prompt_embeds"),
    (0, {"echo": True, "prompt_embeds": "EMBEDS"}, "echo"),
    (0, {"prompt_embeds": "WIDE"}, "prompt_embeds"),                                 # another width
    (0, {}, "prompt"),
])
def test_bad_prompt_embeds_are_400s_naming_the_field(urls, server, body, param):
    rows = hf_rows("llama", IDS)
    fill = {"EMBEDS": torch_b64(rows), "WIDE": torch_b64(np.zeros((3, rows.shape[1] + 2), np.float32)),
            "AAAA": torch_b64(rows)}
    body = {k: fill.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
    response = post(urls[server], **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert post(urls[server], prompt=IDS).status_code == 200   # the engine serves on


def test_the_default_body_limit_holds_a_whole_context_of_fp32_rows():
    from jaxpaged.server.json_body import default_max_request_body_bytes

    width, context = 512, 4096
    body = len('{"model": "m", "max_tokens": 16, "prompt_embeds": ""}') + len(
        torch_b64(np.zeros((context - 1, width), np.float32)))
    assert body <= default_max_request_body_bytes(context, width)
    assert default_max_request_body_bytes(context) < body   # what a token-only server allows would not do


def test_a_tensor_reaching_past_its_storage_is_refused():
    """Sizes and strides are the file's to claim: a view past the stored values is an error, not a read."""
    import torch

    buffer = io.BytesIO()
    torch.save(torch.zeros(2, 3), buffer)
    raw = buffer.getvalue()
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        files = {name: z.read(name) for name in z.namelist()}
    pkl = next(name for name in files if name.endswith("data.pkl"))
    # the pickled size (2, 3) becomes (2, 300): 600 values claimed of 6 stored
    files[pkl] = files[pkl].replace(b"K\x02K\x03\x86", b"K\x02M,\x01\x86")
    assert files[pkl] != pickle.dumps(None) and b"M,\x01" in files[pkl]
    forged = io.BytesIO()
    with zipfile.ZipFile(forged, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    with pytest.raises(ValueError, match="past its storage"):
        decode_base64(base64.b64encode(forged.getvalue()).decode())
