"""OpenAI-compatible routes on Starlette; the engine is reached only through AsyncLLM.

Each route reads its body (json_body.py), parses it (protocol.py), checks the model and key,
and hands the engine's outputs to a Reply (responses.py). Errors leave as OpenAI error objects:
400/401/404/413 for what the client sent, 500 for a failure inside one request, which leaves
the engine loop running.
"""

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid

import numpy as np

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

import jaxpaged
from jaxpaged import AsyncLLM
from jaxpaged.chat_utils import render_chat_images
from jaxpaged.engine.async_llm import EngineOverloadedError
from jaxpaged.sampling_params import truncate_prompt
from jaxpaged.server import protocol as P
from jaxpaged.server.adapters import load_lora_adapter, unload_lora_adapter
from jaxpaged.server.embeddings import create_classify, create_embeddings, create_rerank, create_score
from jaxpaged.server.json_body import default_max_request_body_bytes, read_json
from jaxpaged.server.metrics import MetricsExporter
from jaxpaged.server.openapi import openapi_schema
from jaxpaged.server.response_types import ModelList
from jaxpaged.server.responses import Reply, internal_error, prepend
from jaxpaged.server.tools import ToolSettings, plan_tools
from jaxpaged.server.responses_api import ResponseStore, create_response, stored_response
from jaxpaged.server.tokens import detokenize, tokenize

logger = logging.getLogger(__name__)


def _json(body: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return Response(text, status_code=status, media_type="application/json", headers=headers)


async def _last_outputs(streams) -> list:
    finals = []
    for stream in streams:   # all are in the engine already; reading them in turn loses nothing
        async for out in stream:
            pass
        finals.append(out)
    return finals


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body is already read, so nothing else arrives)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, awaitable) -> tuple[bool, object]:
    """(False, its result), or (True, None) when the client hangs up first: then `awaitable` is
    cancelled, and so are the request streams it reads (which aborts them in the engine)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:   # also when this handler is cancelled (uvicorn's shutdown timeout): no task outlives it
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if not work.cancelled():
        return False, work.result()
    return True, None


async def _close(gens) -> None:
    """Close request streams: finished ones as no-ops; the rest abort in the engine (frees their blocks)."""
    for gen in gens:
        await gen.aclose()


def _truncated(prompt: dict, ids: list[int], cut: list[int]) -> tuple[dict, list[int]]:
    """An input whose tokens `ids` were cut to their last `cut`: its prompt dict then holds only those (a
    prompt of embeddings, its last rows)."""
    if len(cut) == len(ids):
        return prompt, ids
    if "prompt_embeds" in prompt:
        return {"prompt_embeds": prompt["prompt_embeds"][len(ids) - len(cut):]}, cut
    return {"prompt_token_ids": cut}, cut


def engine_dead() -> P.APIError:
    return P.APIError(503, "the engine loop is not running", code="engine_dead", type="server_error")


class _Server:
    def __init__(self, engine: AsyncLLM, names: list[str] | None, api_key: str | None,
                 tool_settings: ToolSettings | None = None, chat_template: str | None = None,
                 vllm_metric_names: bool = False, loras: list | None = None,
                 max_request_body_bytes: int | None = None):
        self.engine, self.api_key = engine, api_key
        embeds_width = engine.model_config.hidden_size if engine.args.enable_prompt_embeds else 0
        # images in chat messages: the engine's ImageInputs, or why it takes none (chat_utils.render_chat_images)
        inputs = engine.engine.replicas()[0].input_processor
        self.images = inputs.images or inputs.no_images
        self.max_request_body_bytes = default_max_request_body_bytes(
            engine.max_model_len, embeds_width, inputs.images is not None) \
            if max_request_body_bytes is None else max_request_body_bytes
        # --enable-lora: adapter name -> LoRARequest (None: LoRA off, the adapter routes answer 404)
        self.loras = None if loras is None else {r.lora_name: r for r in loras}
        self.next_lora_id = max((r.lora_int_id for r in loras or []), default=0) + 1   # server/adapters.py
        self.tool_settings = tool_settings or ToolSettings()
        self.chat_template = chat_template   # None: the tokenizer's own
        self.names = list(names or [engine.model_name])
        self.tokenizer = engine.get_tokenizer()
        self.metrics = MetricsExporter(engine, self.names[0], vllm_metric_names)
        self.created = int(time.time())
        self.openapi_doc = None
        self.responses = ResponseStore()   # /v1/responses stored with store true (previous_response_id, GET)

    # ---- helpers -------------------------------------------------------------------------
    async def read_json(self, request: Request) -> dict:
        """The request's JSON object: every POST route reads its body here, within the size bound."""
        return await read_json(request, self.max_request_body_bytes)

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        token = header[7:] if header[:7].lower() == "bearer " else ""
        if not secrets.compare_digest(token.encode(), self.api_key.encode()):
            raise P.APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'", None,
                             "invalid_api_key")

    def model(self, requested: str | None) -> str:
        if requested is not None and requested not in self.names and requested not in (self.loras or {}):
            raise P.APIError(404, f"The model `{requested}` does not exist; this server serves "
                                  f"{', '.join([*self.names, *(self.loras or {})])}", "model", "model_not_found")
        return requested or self.names[0]

    def need_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise P.APIError(400, "this model has no tokenizer: send prompts as token ids", param, "invalid_value")
        return self.tokenizer

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""

    def prompt_text(self, out) -> str:
        if out.prompt is not None:
            return out.prompt
        if self.tokenizer is None or out.prompt_token_ids is None:   # (a prompt of embeddings has no text)
            return ""
        return self.tokenizer.decode(out.prompt_token_ids)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool | None = True,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None,
                    continue_final_message: bool | None = False,
                    mm_kwargs: dict | None = None) -> tuple[str, list[int], list]:
        """The conversation's text, token ids and images (image_url parts). add_generation_prompt None: not given,
        so true unless continue_final_message (vLLM's fields); 400 naming the field for what the template
        refuses, or for an image this model cannot take or Pillow cannot read; `mm_kwargs`: the request's
        mm_processor_kwargs."""
        tokenizer = self.need_tokenizer("messages")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        try:
            text, images = render_chat_images(tokenizer, messages, self.images, tools, self.chat_template,
                                              add_generation_prompt, template_kwargs, bool(continue_final_message))
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            if images:   # the tokens the model sees: each image's placeholder expanded
                ids, images = self.images.expanded(ids, images, mm_kwargs)
        except Exception as exc:   # no template, the template's own checks (roles, order), a clashing variable
            param = next((p for p in ("chat_template_kwargs", "continue_final_message", "mm_processor_kwargs")
                          if str(exc).startswith(p)), "messages")
            image = str(exc).startswith(("messages[", "the conversation's image", "the prompt has",
                                         "mm_processor_kwargs"))
            raise P.APIError(400, str(exc) if image else f"messages could not be rendered with the chat template: "
                             f"{exc}", param, "invalid_value") from None
        return text, ids, images

    def observe(self, out) -> None:
        if out.finished:
            self.metrics.observe_finished(out)

    # ---- generation ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        req = P.parse_completion_request(await self.read_json(request))
        inputs = []
        for prompt in req.prompts:
            if isinstance(prompt, str):
                ids = list(self.need_tokenizer("prompt").encode(prompt))
                inputs.append(({"prompt": prompt, "prompt_token_ids": ids}, ids))
            elif isinstance(prompt, np.ndarray):   # prompt_embeds: its rows stand for tokens
                inputs.append(({"prompt_embeds": prompt}, [0] * len(prompt)))
            else:
                inputs.append(({"prompt_token_ids": prompt}, prompt))
        return await self.generate(request, req, inputs, "cmpl")

    async def chat(self, request: Request) -> Response:
        req = P.parse_chat_request(await self.read_json(request))
        tools = plan_tools(req, self.tool_settings)
        forced = tools is not None and tools.constraint is not None   # "required" or a named function
        if forced:
            req.tool_constraint = tools.constraint
        text, ids, images = await asyncio.to_thread(   # (an image URL is fetched and decoded off the loop)
            self.render_chat, req.messages, req.request.add_generation_prompt, req.tools,
            req.request.chat_template_kwargs, req.request.continue_final_message, req.request.mm_processor_kwargs)
        prompt = {"prompt": text, "prompt_token_ids": ids}
        if images:
            prompt["multi_modal_data"] = {"image": images}
        try:
            return await self.generate(request, req, [(prompt, ids)], "chatcmpl", tools)
        except P.APIError as exc:
            if forced and exc.param == "structured_outputs":   # the constraint is built from the tools
                raise P.APIError(exc.status, f"the tools' parameters do not compile as a JSON schema: {exc.message}",
                                 "tools", exc.code) from None
            raise

    async def generate(self, request: Request, req: P.ParsedRequest, inputs: list, prefix: str,
                       tools=None, reply_type=Reply) -> Response:
        """Run a parsed generation request's prompts; its answer built by `reply_type` (Reply: chat or
        completion; responses_api.ResponsesReply), whole or streamed."""
        model = self.model(req.model)
        keep = req.request.truncate_prompt_tokens
        if keep is not None:   # vLLM's left truncation, before the context-length rule is checked; a cut
            # prompt's text is dropped, so that an echo shows the tokens the model saw
            inputs = [_truncated(prompt, ids, truncate_prompt(ids, keep, self.engine.max_model_len))
                      for prompt, ids in inputs]
        P.plan_reasoning(req, self.engine.args.reasoning_parser)
        params = [P.build_sampling_params(req, len(ids), self.engine.max_model_len) for _, ids in inputs]
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        salt = req.request.cache_salt   # checked by protocol.py; the engine hashes it into the first block
        if salt is not None:
            inputs = [({**prompt, "cache_salt": salt}, ids) for prompt, ids in inputs]
        lora = (self.loras or {}).get(model)   # a request naming an adapter runs with it
        priority = req.request.priority or 0
        gens = [self.engine.generate(prompt, sp, f"{request_id}-{i}", output_kind="cumulative", lora_request=lora,
                                     priority=priority) for i, ((prompt, _), sp) in enumerate(zip(inputs, params))]
        # a client that hangs up before its first token (a long prefill) aborts its requests then
        gone, firsts = await _unless_disconnected(request, asyncio.gather(*(anext(g) for g in gens),
                                                                          return_exceptions=True))
        if gone:
            await _close(gens)
            return Response(status_code=499)
        error = next((f for f in firsts if isinstance(f, BaseException)), None)
        if error is not None:
            await _close(gens)
            if isinstance(error, ValueError):
                raise P.bad_request(error, req)
            if isinstance(error, EngineOverloadedError):   # --max-num-waiting: come back later, not a failure
                raise P.APIError(503, str(error), None, "overloaded", "server_error", {"Retry-After": "1"})
            if not self.engine.is_running:
                raise engine_dead()
            raise error
        streams = [prepend(first, gen) for first, gen in zip(firsts, gens)]
        reply = reply_type(self, req, model, request_id, params[0], tools)
        if req.stream:
            return StreamingResponse(reply.events(streams), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            gone, finals = await _unless_disconnected(request, _last_outputs(streams))
        finally:
            await _close(gens)
        if gone:   # nobody will read the answer: its blocks are free now
            return Response(status_code=499)
        return _json(reply.whole(finals))

    def route(self, serve):
        """The handler of a route served elsewhere (server/embeddings.py, responses_api.py, adapters.py, tokens.py):
        `serve(server, request)` returns its Response, or a body sent as JSON."""
        async def handler(request: Request) -> Response:
            out = await serve(self, request)
            return out if isinstance(out, Response) else _json(out)
        return handler

    # ---- the other routes ----------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "jaxpaged",
                 "root": self.engine.args.model or self.engine.model_name, "max_model_len": self.engine.max_model_len}
                for name in self.names]
        data += [{"id": name, "object": "model", "created": self.created, "owned_by": "jaxpaged",
                  "root": lora.lora_path, "parent": self.names[0], "max_model_len": self.engine.max_model_len}
                 for name, lora in (self.loras or {}).items()]
        return _json(ModelList.model_validate({"object": "list", "data": data}).model_dump(mode="json"))

    async def health(self, request: Request) -> Response:
        if self.engine.is_running:
            return Response(status_code=200)
        return _json(engine_dead().to_dict(), 503)

    async def metrics_text(self, request: Request) -> Response:
        body, content_type = self.metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    # ---- sleep mode (--enable-sleep-mode), vLLM's dev routes ------------------------------------
    async def sleep(self, request: Request) -> Response:
        raw = request.query_params.get("level", "1")
        if raw not in ("1", "2"):
            raise P.APIError(400, f"level must be 1 or 2, got {raw!r}", "level", "invalid_value")
        await self.engine.sleep(int(raw))
        return Response(status_code=200)

    def engine_call(self, method: str):
        """A route that awaits AsyncLLM.method() (wake_up, start_profile, stop_profile); 200, empty."""
        async def handler(request: Request) -> Response:
            await getattr(self.engine, method)()
            return Response(status_code=200)
        return handler

    async def is_sleeping(self, request: Request) -> Response:
        return _json({"is_sleeping": await self.engine.is_sleeping()})

    async def version(self, request: Request) -> Response:
        return _json({"version": jaxpaged.__version__})

    async def openapi(self, request: Request) -> Response:
        if self.openapi_doc is None:   # built on first use (~10 ms)
            self.openapi_doc = openapi_schema()
        return _json(self.openapi_doc)


def _endpoint(server: _Server, handler, guarded: bool):
    async def endpoint(request: Request) -> Response:
        try:
            if guarded:
                server.check_key(request)
            return await handler(request)
        except P.APIError as exc:
            return _json(exc.to_dict(), exc.status, exc.headers)
        except ValueError as exc:   # a user-triggered check deeper down
            return _json(P.APIError(400, str(exc), code="invalid_value").to_dict(), 400)
        except Exception as exc:
            if not server.engine.is_running:   # the engine loop died under this request
                return _json(engine_dead().to_dict(), 503)
            logger.exception("%s %s failed", request.method, request.url.path)
            return _json(internal_error(exc).to_dict(), 500)
    return endpoint


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _json(P.APIError(exc.status_code, str(exc.detail), None, code).to_dict(), exc.status_code)


def build_app(engine: AsyncLLM, served_model_names: list[str] | None = None, api_key: str | None = None,
              tool_settings: ToolSettings | None = None, chat_template: str | None = None,
              vllm_metric_names: bool = False, enable_sleep_mode: bool = False,
              lora_modules: list | None = None, max_request_body_bytes: int | None = None) -> Starlette:
    """The Starlette app serving `engine`; the first served name is the one responses report.
    `tool_settings`: --enable-auto-tool-choice / --tool-call-parser; `chat_template`: a Jinja
    template replacing the tokenizer's; `vllm_metric_names`: /metrics also under vLLM's names;
    `enable_sleep_mode`: the /sleep, /wake_up and /is_sleeping routes (API key guarded);
    `lora_modules`: LoRARequests served by name (a list, even empty, when the engine has
    enable_lora: /v1/load_lora_adapter and /v1/unload_lora_adapter change it);
    `max_request_body_bytes`: larger bodies get a 413 unread (None: json_body's default for the
    engine's max_model_len)."""
    if lora_modules is None and engine.args.enable_lora:
        lora_modules = []
    server = _Server(engine, served_model_names, api_key, tool_settings, chat_template, vllm_metric_names,
                     lora_modules, max_request_body_bytes)
    table = [("/v1/completions", server.completions, "POST"), ("/v1/chat/completions", server.chat, "POST"),
             ("/v1/responses", server.route(create_response), "POST"),
             *[("/v1/responses/{response_id}", server.route(stored_response), m) for m in ("GET", "DELETE")],
             ("/v1/embeddings", server.route(create_embeddings), "POST"), ("/v1/models", server.models, "GET"),
             *[(path, server.route(create_classify), "POST") for path in ("/classify", "/v1/classify")],
             *[(path, server.route(create_score), "POST") for path in ("/score", "/v1/score")],
             *[(path, server.route(create_rerank), "POST") for path in ("/rerank", "/v1/rerank", "/v2/rerank")],
             ("/health", server.health, "GET"),
             ("/metrics", server.metrics_text, "GET"), ("/tokenize", server.route(tokenize), "POST"),
             ("/detokenize", server.route(detokenize), "POST"), ("/version", server.version, "GET"),
             ("/openapi.json", server.openapi, "GET"),
             ("/v1/load_lora_adapter", server.route(load_lora_adapter), "POST"),
             ("/v1/unload_lora_adapter", server.route(unload_lora_adapter), "POST")]
    # besides /v1/*: the routes that run the model or put it to sleep (an API key guards them too)
    guarded = {"/sleep", "/wake_up", "/is_sleeping", "/classify", "/score", "/rerank", "/v2/rerank", "/start_profile",
               "/stop_profile"}
    if enable_sleep_mode:
        table += [("/sleep", server.sleep, "POST"), ("/wake_up", server.engine_call("wake_up"), "POST"),
                  ("/is_sleeping", server.is_sleeping, "GET")]
    if engine.args.profiler_config is not None:   # vLLM's routes, where a profiler is configured
        table += [(f"/{name}", server.engine_call(name), "POST") for name in ("start_profile", "stop_profile")]
    routes = [Route(path, _endpoint(server, handler, path.startswith("/v1/") or path in guarded), methods=[method])
              for path, handler, method in table]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error})
    app.state.server = server
    return app
