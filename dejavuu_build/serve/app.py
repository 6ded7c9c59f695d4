"""The OpenAI-compatible HTTP API (FastAPI) over the scheduler.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or server-sent events,
``usage`` filled in; each streamed piece says in ``dejavuu`` which text came from accepted draft
tokens: serve.marks), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text),
``GET /info`` (methods and defaults) and ``GET /`` (the chat page, files in ``static/``).
Request fields: ``max_tokens`` (chat also ``max_completion_tokens``), ``temperature``,
``top_p``, ``seed``, ``stop``, ``stream`` (+ ``stream_options.include_usage``), ``n`` = 1; our
extensions: ``method``, ``tree``, ``top_k``, ``memory_key`` (the drafter-memory namespace).
VLM builds take ``image_url`` parts with ``data:`` URLs (nothing is fetched).

Every error is OpenAI-shaped JSON (``{"error": {"message", "type", "param", "code"}}``) with its
status: 400 bad body or settings (unsupported fields such as ``tools`` included), 404 unknown model
or route, 408/413/503 a body too slow, too large, or past the bound of all bodies together (serve.guard,
while it is read), 429 queue full, 500 a bug. The body is parsed by hand (not by FastAPI's
validator) so that a malformed body is a 400 in that shape rather than a 422 in another, whatever
its depth.

Work that grows with a request (parsing, tokenizing, decoding images) runs in a worker thread,
never on the event loop, so one large request does not stall /health or the other streams.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import math
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import DejavuuError, GenerationError
from ..log import logger
from ..runtime.job import STEP_ROOM
from ..runtime.settings import DecodeSettings, SettingsError
from ..runtime.stops import cut
from .guard import DEFAULT_BODY_TIMEOUT, BodyGuard
from .marks import MarkedStream
from .scheduler import Cancelled, QueueFull, Request, Result, Scheduler

if TYPE_CHECKING:
    from ..runtime.model import Model

DEFAULT_MAX_TOKENS = 256
MAX_BODY = 32 << 20  # bytes; a data: URL image fits, a runaway upload does not


class APIError(Exception):
    """An error the client caused or should see, with its HTTP status and OpenAI fields."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}},
            status_code=self.status,
        )


# ---------------------------------------------------------------------- request bodies
class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Body(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)  # NaN: "finite", not "<= 2"
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    logprobs: Union[bool, int, None] = None
    # extensions
    method: str | None = None
    tree: bool | None = None
    top_k: int = Field(0, ge=0)
    memory_key: str | None = Field(None, min_length=1, max_length=200)
    # OpenAI fields this server does not implement: refused (400) rather than silently ignored
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: Any = None

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 non-empty stop strings")
        return stops


class ImageURL(_Strict):
    url: str


class Part(_Strict):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None


class Message(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[Part], None] = None


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionBody(_Body):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False
    suffix: str | None = None


FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}


# ---------------------------------------------------------------------- the app
def create_app(
    model: Model,
    scheduler: Scheduler,
    *,
    served_name: str,
    defaults: DecodeSettings | None = None,
    memory_key: str | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT,
) -> FastAPI:
    """The FastAPI app serving ``model`` through ``scheduler`` under the name ``served_name``
    (request bodies capped at ``MAX_BODY`` and ``body_timeout`` seconds while they are read: guard).
    Each request decodes with ``defaults`` (the server's method, tree and draft budget) under the
    settings its body names (``request_settings``); None: the ``auto`` method and the default budget."""
    from ..runtime.drafters import METHODS
    from .metrics import render_metrics

    defaults = defaults if defaults is not None else DecodeSettings(method="auto")
    app = FastAPI(title="dejavuu-build", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyGuard, max_body=MAX_BODY, body_timeout=body_timeout)
    app.state.scheduler = scheduler
    created = int(time.time())
    namespace = memory_key or served_name
    tok = model.tokenizer
    limits = [
        x
        for x in (
            model.contract.max_positions,
            model.decoder.capacity,
            scheduler.batch.capacity if scheduler.batch else 0,
        )
        if x
    ]
    limit = min(limits) if limits else 0
    token_chars = longest_token(tok) if tok is not None else 0

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return APIError(
            e.status_code,
            str(e.detail),
            "invalid_request_error" if e.status_code < 500 else "server_error",
            code="not_found" if e.status_code == 404 else None,
        ).response()

    @app.exception_handler(Exception)
    async def _bug(_, e: Exception):
        logger.exception("request failed")
        return APIError(500, f"internal error: {type(e).__name__}", "server_error").response()

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": served_name,
            "batched": scheduler.batched,
            "active": scheduler.active_count(),
            "queued": scheduler.queue_depth(),
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": served_name, "object": "model", "created": created, "owned_by": "dejavuu-build"}],
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(scheduler), media_type="text/plain; version=0.0.4")

    @app.get("/info")
    async def info():
        """What the page (and any client) may choose from: methods, defaults, images or not."""
        return {
            "model": served_name,
            "methods": list(METHODS),
            "method": defaults.method_name,
            "tree": defaults.tree,
            "tree_capable": bool(model.tree_capable and model.tree_period is not None),
            "vision": model.vision is not None,
            "batched": scheduler.batched,
            "context": limit,
            "max_tokens": DEFAULT_MAX_TOKENS,
        }

    @app.get("/")
    async def page():
        return page_file("index.html")

    @app.get("/static/{name}")
    async def static(name: str):
        if name not in PAGE_FILES or name == "index.html":
            raise APIError(404, f"no static file {name!r}", code="not_found")
        return page_file(name)

    async def parse(request: HTTPRequest, cls):
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise APIError(413, f"the body is larger than {MAX_BODY >> 20} MiB", code="body_too_large")
        body = await asyncio.to_thread(parse_body, raw, cls)
        if body.model != served_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {served_name!r}",
                param="model",
                code="model_not_found",
            )
        if body.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        refuse_unsupported(body)
        return body

    def settings(body: _Body, max_tokens: int | None, n_prompt: int) -> DecodeSettings:
        mt = max_tokens or DEFAULT_MAX_TOKENS
        if max_tokens is None and limit:
            mt = max(1, min(mt, limit - n_prompt - STEP_ROOM))
        if limit and n_prompt + mt + STEP_ROOM > limit:  # as Engine.run: generate takes the same requests
            raise APIError(
                400,
                f"the prompt ({n_prompt} tokens) plus max_tokens ({mt}) exceeds this model's context "
                f"of {limit - STEP_ROOM} tokens: shorten the prompt or lower max_tokens",
                param="max_tokens" if max_tokens else "messages",
                code="context_length_exceeded",
            )
        seed = body.seed if body.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "little")
        return request_settings(body, defaults, mt, seed)

    def too_long(n_chars: int, param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit: every token stands for at most
        ``token_chars`` characters, so more than ``limit`` tokens' worth is over the context."""
        if limit and n_chars > 2 * token_chars * limit + 4096:
            raise APIError(
                400,
                f"the prompt ({n_chars} characters) cannot fit this model's context of {limit} tokens: shorten it",
                param=param,
                code="context_length_exceeded",
            )

    def encode_chat(body: ChatBody):
        vision = model.vision
        images, msgs, vlm = [], [], vision is not None
        too_long(
            sum(
                len(m.content) if isinstance(m.content, str) else sum(len(p.text or "") for p in m.content or ())
                for m in body.messages
            ),
            "messages",
        )
        for i, msg in enumerate(body.messages):
            if isinstance(msg.content, list):
                parts = []
                for part in msg.content:
                    if part.type == "text":
                        if part.text is None:
                            raise APIError(400, "a text part needs `text`", param=f"messages.{i}.content")
                        parts.append({"type": "text", "text": part.text})
                    else:
                        if not vlm:
                            raise APIError(400, f"{served_name} takes no images", param=f"messages.{i}.content")
                        if part.image_url is None:
                            raise APIError(400, "an image_url part needs `image_url`", param=f"messages.{i}.content")
                        images.append(data_url_image(part.image_url.url, f"messages.{i}.content"))
                        parts.append({"type": "image"})
                content = parts if vlm else "".join(p["text"] for p in parts)
            else:
                content = msg.content or ""
                if vlm:
                    content = [{"type": "text", "text": content}]
            msgs.append({"role": msg.role, "content": content})
        try:
            if images and vision is not None:  # (images are refused above without vision)
                ids, embeds = vision.prefill(msgs, images, tok, model.decoder.embed)
                return ids, embeds
            return model.encode(msgs), None
        except GenerationError as e:
            raise APIError(400, str(e), param="messages") from None

    def encode_prompt(body: CompletionBody):
        p = body.prompt
        if body.echo or body.suffix:
            raise APIError(400, "echo and suffix are not supported", param="echo" if body.echo else "suffix")
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise APIError(400, "one prompt per request", param="prompt")
            p = str(p[0])
        if isinstance(p, list):
            if not p:
                raise APIError(400, "the prompt is empty", param="prompt")
            V = model.contract.vocab_size
            if limit and len(p) > limit:
                raise APIError(
                    400,
                    f"the prompt ({len(p)} tokens) exceeds this model's context of {limit} tokens: shorten it",
                    param="prompt",
                    code="context_length_exceeded",
                )
            if any(not isinstance(t, int) or not 0 <= t < V for t in p):
                raise APIError(400, f"token ids must be in [0, {V})", param="prompt")
            return [int(t) for t in p], None
        too_long(len(p), "prompt")
        try:
            return model.encode(p), None
        except GenerationError as e:
            raise APIError(400, str(e), param="prompt") from None

    async def run(
        request: HTTPRequest,
        body: _Body,
        ids,
        embeds,
        prm: DecodeSettings,
        kind: str,
        include_usage: bool,
        stream: bool,
    ):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req = Request(
            ids,
            prm,
            lambda t: loop.call_soon_threadsafe(q.put_nowait, ("tokens", t)),
            lambda r: loop.call_soon_threadsafe(q.put_nowait, ("done", r)),
            prefill_embeds=embeds,
            namespace=body.memory_key or namespace,
        )
        try:
            scheduler.submit(req)
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_exceeded", code="queue_full") from None
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if stream:
            return StreamingResponse(
                sse(req, q, rid, prm, kind, include_usage, len(ids)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            while True:
                try:
                    what, val = await asyncio.wait_for(q.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        req.cancel()
                        raise APIError(499, "the client went away") from None
                    continue
                if what == "done":
                    break
        except asyncio.CancelledError:
            req.cancel()
            raise
        res = done_result(val)
        text = cut(tok.decode(res.tokens), prm.stop) if tok is not None else ""
        usage = {
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": len(res.tokens),
            "total_tokens": res.prompt_tokens + len(res.tokens),
        }
        finish = FINISH.get(res.stop_reason, "stop")
        ext = ext_stats(res)
        if kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": served_name,
            "choices": [choice],
            "usage": usage,
            "dejavuu": ext,
        }

    def done_result(val) -> Result:
        if isinstance(val, Result):
            return val
        if isinstance(val, Cancelled):
            raise APIError(499, str(val))
        if isinstance(val, GenerationError):
            raise APIError(400, str(val))
        if isinstance(val, DejavuuError):
            raise APIError(500, str(val), "server_error")
        logger.error("generation failed: %r", val)
        raise APIError(500, f"internal error: {type(val).__name__}", "server_error")

    async def sse(
        req: Request, q: asyncio.Queue, rid: str, prm: DecodeSettings, kind: str, include_usage: bool, n_prompt: int
    ):
        ts = MarkedStream(tok, prm.stop) if tok is not None else None  # without a tokenizer: no text
        created_ = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(
            text: str | None, finish: str | None = None, first: bool = False, spans: list[dict] | None = None
        ) -> str:
            if kind == "chat":
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            out = {"id": rid, "object": obj, "created": created_, "model": served_name, "choices": [choice]}
            if ts is not None and not first:  # our extension: how this piece was produced (docs/serving.md)
                out["dejavuu"] = {"spans": spans or [], "steps": ts.take_steps()}
            return "data: " + json.dumps(out) + "\n\n"

        def piece(spans: list[dict]) -> str:
            return chunk("".join(s["text"] for s in spans), spans=spans)

        try:
            if kind == "chat":
                yield chunk(None, first=True)
            while True:
                what, val = await q.get()
                if what == "tokens":
                    if ts is not None and (spans := ts.push(val)):
                        yield piece(spans)
                    continue
                try:
                    res = done_result(val)
                except APIError as e:
                    yield (
                        "data: "
                        + json.dumps(
                            {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
                        )
                        + "\n\n"
                    )
                    return
                if ts is not None and (rest := ts.finish()):
                    yield piece(rest)
                yield chunk(None, FINISH.get(res.stop_reason, "stop"))
                if include_usage:
                    yield (
                        "data: "
                        + json.dumps(
                            {
                                "id": rid,
                                "object": obj,
                                "created": created_,
                                "model": served_name,
                                "choices": [],
                                "usage": {
                                    "prompt_tokens": n_prompt,
                                    "completion_tokens": len(res.tokens),
                                    "total_tokens": n_prompt + len(res.tokens),
                                },
                                "dejavuu": ext_stats(res),
                            }
                        )
                        + "\n\n"
                    )
                yield "data: [DONE]\n\n"
                return
        finally:
            req.cancel()  # no-op once finished; frees the slot at once when the client left

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        body = await parse(request, ChatBody)
        if tok is None:
            raise APIError(400, f"{served_name} has no tokenizer: use /v1/completions with token ids")
        ids, embeds = await asyncio.to_thread(encode_chat, body)
        prm = settings(body, body.max_completion_tokens or body.max_tokens, len(ids))
        return await run(
            request,
            body,
            ids,
            embeds,
            prm,
            "chat",
            bool(body.stream_options and body.stream_options.include_usage),
            body.stream,
        )

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        body = await parse(request, CompletionBody)
        ids, embeds = await asyncio.to_thread(encode_prompt, body)
        prm = settings(body, body.max_tokens, len(ids))
        return await run(
            request,
            body,
            ids,
            embeds,
            prm,
            "completion",
            bool(body.stream_options and body.stream_options.include_usage),
            body.stream,
        )

    return app


def request_settings(body: _Body, defaults: DecodeSettings, max_new_tokens: int, seed: int) -> DecodeSettings:
    """The settings a request body asks for, over the server's ``defaults`` (its method and tree
    where the body names none, and its draft budget), or a 400 naming the field. ``max_new_tokens``
    and ``seed`` come from the body's, as the server fills them in (context room, a fresh seed)."""
    from ..runtime.drafters import METHODS

    m = body.method or defaults.method
    if m not in METHODS:
        raise APIError(
            400, f"unknown method {m!r}; choose one of: {', '.join(METHODS)}", param="method", code="unknown_method"
        )
    try:
        return replace(
            defaults,
            max_new_tokens=max_new_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=seed,
            stop=tuple(body.stop or ()),
            method=m,
            tree=defaults.tree if body.tree is None else body.tree,
        )
    except SettingsError as e:
        raise APIError(400, str(e), param=BODY_FIELD.get(e.field, e.field)) from None


# a setting's name -> the request field that sets it, where they differ
BODY_FIELD = {"max_new_tokens": "max_tokens"}


def parse_body(raw: bytes, cls):
    """The request body as ``cls``, or a 400 saying what is wrong with it (at any depth: JSON nested
    past the parser's recursion limit is malformed, not a server error)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, "the body is nested too deeply to be a request", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return cls.model_validate(data)
    except RecursionError:
        raise APIError(400, "the body is nested too deeply to be a request", code="invalid_json") from None
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        raise APIError(400, f"{param or 'body'}: {err.get('msg', 'invalid')}", param=param) from None


# The chat page (docs/serving.md): static files shipped in the package, served from a fixed list.
# Its policy lets it load only its own files and talk only to this origin; text is inserted as text.
PAGE_DIR = Path(__file__).parent / "page"
PAGE_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
)


def page_file(name: str) -> Response:
    try:
        data = (PAGE_DIR / name).read_bytes()
    except OSError:
        raise APIError(
            500, f"the page's file {name} is missing from this install (reinstall dejavuu-build)", "server_error"
        ) from None
    return Response(
        data,
        media_type=PAGE_FILES[name],
        headers={
            "Content-Security-Policy": PAGE_POLICY,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        },
    )


def refuse_unsupported(body: _Body) -> None:
    """A 400 naming the field for what this server would otherwise silently ignore: tools and
    function calling, structured output, and an empty ``method`` (which would mean the default)."""
    if body.method is not None and not body.method.strip():
        raise APIError(
            400,
            "method is empty: name a method (GET /info lists them) or leave the field out for the server's default",
            param="method",
            code="unknown_method",
        )
    for name in ("tools", "functions"):
        if getattr(body, name) not in (None, []):
            raise APIError(
                400,
                f"{name} (tool / function calling) are not supported by this server: leave `{name}` out",
                param=name,
                code="unsupported_parameter",
            )
    for name in ("tool_choice", "function_call"):
        if getattr(body, name) not in (None, "none", "auto"):
            raise APIError(
                400,
                f"{name} is not supported by this server (it calls no tools): leave `{name}` out",
                param=name,
                code="unsupported_parameter",
            )
    rf = body.response_format
    if rf is not None and rf != {"type": "text"}:
        raise APIError(
            400,
            "response_format (JSON mode, structured output) is not supported by this server: only "
            '{"type": "text"}, or leave `response_format` out',
            param="response_format",
            code="unsupported_parameter",
        )


def longest_token(tok) -> int:
    """The most characters any one token of ``tok`` stands for (decoded, specials included)."""
    vocab = tok.tok.get_vocab(with_added_tokens=True)
    return max(
        [1] + [len(tok.tok.decode([i], skip_special_tokens=False)) for i in vocab.values()] + [len(t) for t in vocab]
    )


def ext_stats(res: Result) -> dict:
    """Our extension beside ``usage``: how the answer was decoded (verify steps, drafts accepted)."""
    return {
        "method": res.method,
        "tree": res.tree,
        "batched": res.batched,
        "steps": res.stats.steps,
        "accepted": res.stats.accepted,
        "drafted": res.stats.drafted,
        "seconds": round(res.stats.total_s, 4),  # from admission to the last token, prefill included
        "prefill_seconds": round(res.stats.prefill_s, 4),
    }


def data_url_image(url: str, param: str):
    """A PIL image from a ``data:image/...;base64,`` URL; remote URLs are refused (nothing is fetched)."""
    if not url.startswith("data:"):
        raise APIError(400, "only data: URLs are accepted for images (no remote fetching)", param=param)
    head, sep, payload = url.partition(",")
    if not sep or ";base64" not in head or not head[5:].startswith("image/"):
        raise APIError(400, "an image URL must look like data:image/png;base64,...", param=param)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "the image's base64 payload is invalid", param=param) from None
    try:
        from PIL import Image

        img = Image.open(io.BytesIO(raw))
        img.load()
        return img
    except ImportError:
        raise APIError(500, "images need Pillow on the server (pip install pillow)", "server_error") from None
    except Exception:  # noqa: BLE001 - PIL raises many types for a bad file
        raise APIError(400, "the image could not be decoded", param=param) from None
