"""LoRA adapters while serving (--enable-lora), vLLM's routes: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter change the adapters `model` may name (`server.loras`)."""

from starlette.responses import Response

from jaxpaged.server import protocol as P
from jaxpaged.server.vllm_types import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest


async def _lora_request(server, request, model):
    body = await server.read_json(request)
    if server.loras is None:
        raise P.APIError(404, "LoRA adapters are not enabled: start the server with --enable-lora", None, "not_found")
    return P.validate(model, body)


async def load_lora_adapter(server, request) -> Response:
    from jaxpaged.lora import LoRARequest
    adapter = await _lora_request(server, request, LoadLoRAAdapterRequest)
    name, path = adapter.lora_name, adapter.lora_path
    if name in server.loras or name in server.names:
        raise P.APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name", "invalid_value")
    lora = LoRARequest(name, server.next_lora_id, path)
    try:
        await server.engine.add_lora(lora)
    except ValueError as exc:
        raise P.APIError(400, str(exc), "lora_path", "invalid_value") from None
    server.next_lora_id += 1
    server.loras[name] = lora
    return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")


async def unload_lora_adapter(server, request) -> Response:
    name = (await _lora_request(server, request, UnloadLoRAAdapterRequest)).lora_name
    lora = server.loras.pop(name, None)
    if lora is None:
        raise P.APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "not_found")
    await server.engine.remove_lora(lora.lora_int_id)   # requests running with it finish with it
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
