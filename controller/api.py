"""The HTTP front door: a FastAPI app served by a Ray Serve ingress deployment.

Routes
------
``POST /v1/completions``, ``POST /v1/chat/completions``
    OpenAI-compatible (``stream: true`` ⇒ SSE ``data: {...}`` chunks ending ``data: [DONE]``). The SLO
    tier comes from the ``fsd.tier`` body field, else the ``x-slo-tier`` header, else the default tier;
    ``fsd.threshold`` pins T for this request within the tier's bounds. Responses carry ``usage`` and an
    ``fsd`` object (tier, threshold, acceptance rate, mean accepted length, distortion).
``GET /v1/fsd/status``
    T per tier, last telemetry window, active and shadow policy, replicas, recent history.
``PUT /v1/fsd/slo`` (admin), ``PUT /v1/fsd/policy[?shadow=true]`` (admin)
    Replace the SLO / the active or shadow policy; validated before anything changes.
``POST /v1/fsd/policy/promote`` (admin), ``GET /v1/fsd/recording`` (admin)
    Make the shadow policy live; the traffic recording as a trace CSV (see docs/rollout.md).
``GET /metrics`` (Prometheus text), ``GET /healthz``, ``GET /v1/models``.

Status codes (errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``, the message
names the field):

=====  ===================================================================================================
400    every bad request, as OpenAI and vLLM answer it: body not UTF-8, not JSON (or nested too deeply),
       not a JSON object; a field with a wrong type or value (NaN/inf, ``max_tokens`` ≤ 0 or above the
       limit, empty prompt, unknown role, non-text content part, unknown tier, T outside the tier's
       bounds); an OpenAI parameter this server does not implement (``n > 1``, ``logprobs``, ``tools``…,
       ``code: unsupported_parameter``); prompt + max_tokens over the model's context; invalid SLO or
       policy spec; a bad query parameter
401    admin call without a bearer token;  403: wrong token, or no admin token configured
404    unknown ``model`` or path;  405: wrong method
413    body larger than ``http.max_body_bytes``
500    an internal error: the body names the request id only; the traceback goes to the log with that id
503    overload (replica queue or Serve's queue full) or no replica available — with ``Retry-After``
504    the request did not finish within ``http.request_timeout_s``
=====  ===================================================================================================

Request ids: Ray Serve's proxy echoes ``X-Request-Id`` (or generates one); the ingress logs with it and
names it in 500 bodies. Streams follow OpenAI (and what ``vllm bench serve`` reads): the first chunk
carries the first text (with ``role`` on chat), the last choice chunk the ``finish_reason`` and ``fsd``,
and with ``stream_options.include_usage`` a final chunk with ``choices: []`` carries ``usage`` (every
other chunk then has ``usage: null``).
"""

# No `from __future__ import annotations`: FastAPI must resolve `Request` annotations at route
# registration, and Serve's ingress wrapper does not carry this module's globals.
import asyncio
import hmac
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.config import FSDConfig, parse_config
from controller.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedParameterError,
    check_unsupported,
)
from controller.protocol import chunk_as_dict
from controller.recording import RequestRecording, TrafficRecorder
from controller.rollout import ShadowEstimator
from fsd_common.validation import first_error_path, format_validation_error

logger = logging.getLogger("ray.serve")

app = FastAPI(title="fsd-runtime", description="SLO-driven Fuzzy Speculative Decoding on Ray Serve")

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def _validation_error(exc: ValidationError) -> HTTPError:
    param = first_error_path(exc)
    message = format_validation_error(exc)
    if param is None and ":" in message:  # whole-model checks start their message with the field's name
        head = message.split(":", 1)[0]
        param = head if head.replace(".", "").replace("_", "").isalnum() else None
    return HTTPError(400, message, param)


def _request_id(request: Request) -> str:
    """The id to log with: ``X-Request-Id`` as Serve's proxy forwards it (it echoes it on the response)."""
    return request.headers.get("x-request-id") or uuid.uuid4().hex


def _internal_error(request_id: str) -> HTTPError:
    # The body never carries a traceback, a remote address or a path; the log does, under this id.
    return HTTPError(500, f"internal server error (request id {request_id}); details are in the server log",
                     code="internal_error")


async def _http_exception(request: Request, exc: Exception) -> Response:
    """FastAPI's own 404 (no such path) / 405 (wrong method) in OpenAI's error shape."""
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return HTTPError(exc.status_code, message, headers=exc.headers).response()


async def _request_validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI's own 422 (a bad query parameter) as OpenAI's 400."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("query", "body", "path", "header")]
        param = param or (".".join(loc) or None)
        parts.append(f"{'.'.join(loc)}: {err.get('msg', 'invalid')}")
    return HTTPError(400, "; ".join(parts) or "invalid request", param).response()


class _UnhandledErrorMiddleware:
    """Last line: an exception no route handled becomes OpenAI's 500 body (id only), logged with its id.

    A pure ASGI middleware (not ``BaseHTTPMiddleware``) so streaming responses pass through untouched.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            request_id = Request(scope).headers.get("x-request-id") or uuid.uuid4().hex
            logger.exception("unhandled error in %s %s (request id %s)", scope.get("method"), scope.get("path"),
                             request_id)
            if started:  # headers are out: nothing left to say in HTTP
                return
            response = _internal_error(request_id).response()
            await response(scope, receive, send)


app.add_exception_handler(StarletteHTTPException, _http_exception)
app.add_exception_handler(RequestValidationError, _request_validation_error)
app.add_middleware(_UnhandledErrorMiddleware)


def _is_backpressure(exc: BaseException) -> bool:
    from ray.serve.exceptions import BackPressureError

    return isinstance(exc, BackPressureError)


def _is_replica_failure(exc: BaseException) -> bool:
    import ray.exceptions as rex
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(exc, rex.RayActorError | rex.ActorUnavailableError | DeploymentUnavailableError)


class _Stream:
    """One replica generation: the first chunk is read eagerly so errors become proper status codes."""

    def __init__(self, generator: Any, first: dict[str, Any]) -> None:
        self.generator = generator
        self.first = first
        self.done = False
        self.recording: RequestRecording | None = None  # traffic recording: sees every chunk, closed at the end

    async def chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        try:
            async for typed in self.generator:
                chunk = chunk_as_dict(typed)  # typed across the Ray boundary; rendered from the JSON view
                if self.recording is not None:
                    self.recording.observe(chunk)
                yield chunk
                if chunk.get("type") == "end":
                    self.done = True
        finally:
            if self.recording is not None:
                self.recording.close()
            if not self.done:
                self.generator.cancel()


def _sse_error(status: int, message: str) -> str:
    # Mid-stream the status line is already 200: the error rides in a chunk, `code` the status (as vLLM).
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return f"data: {json.dumps(body)}\n\n"


def _finite(d: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _cause_message(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    return str(cause) if cause is not None else str(exc).strip().splitlines()[-1]


class _suppress_all:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


# Everything the ingress methods use is defined above this class: Serve serializes the decorated
# class when the decorator runs, so names defined later in the module would not resolve in replicas.
@serve.ingress(app)
class FSDIngress:
    """Validates, routes to a replica, shapes OpenAI responses; admin and status via the controller."""

    def __init__(self, config: Mapping[str, Any], replicas: Any, controller: Any) -> None:
        self._cfg: FSDConfig = parse_config(dict(config))
        self._replicas = replicas
        self._controller = controller
        self._admin_token = self._cfg.http.resolved_admin_token()
        self._recorder = TrafficRecorder.from_config(self._cfg.recording)  # None unless recording.enabled
        self._shadow_estimator = ShadowEstimator(self._cfg, self._recorder)
        self._created = int(time.time())  # `created` of /v1/models: when this deployment came up
        self._max_model_len: int | None = None  # the pair's context, asked of a replica once
        self._ignored_fields_logged: set[str] = set()

    # ---- helpers ---------------------------------------------------------------------------------

    async def _read_json(self, request: Request) -> Any:
        limit = self._cfg.http.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HTTPError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        async for part in request.stream():
            body.extend(part)
            if len(body) > limit:
                raise HTTPError(413, f"request body exceeds the limit of {limit} bytes")
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise HTTPError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
        if not text.strip():
            raise HTTPError(400, "request body is empty; expected a JSON object")
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise HTTPError(400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
        except RecursionError:  # a nesting bomb ([[[[…]]]] thousands deep) must not become a 500
            raise HTTPError(400, "malformed JSON: nested too deeply") from None
        except ValueError as exc:  # e.g. an integer literal beyond Python's digit limit
            raise HTTPError(400, f"malformed JSON: {exc}") from None

    async def _json_object(self, request: Request) -> dict[str, Any]:
        data = await self._read_json(request)
        if not isinstance(data, dict):
            raise HTTPError(400, f"request body must be a JSON object, got {type(data).__name__}")
        return data

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in (self._cfg.model_name, self._cfg.model.pair):
            raise HTTPError(404, f"model {model!r} does not exist; this service serves {self._cfg.model_name!r}",
                            "model", "model_not_found")

    def _check_admin(self, request: Request) -> None:
        if not self._admin_token:
            raise HTTPError(403, "admin API disabled: no admin token configured (set FSD_ADMIN_TOKEN or "
                                 "http.admin_token)")
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise HTTPError(401, "admin call requires 'Authorization: Bearer <token>'",
                            headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), self._admin_token.encode()):
            raise HTTPError(403, "invalid admin token")

    def _overloaded(self, message: str, count: bool = True, tier: str | None = None) -> HTTPError:
        if count:  # refused by Serve's queue before any replica saw it: tell the controller (an SLO miss)
            with _suppress_all():
                self._controller.record_rejections.remote(1, tier)
        return HTTPError(503, message, code="overloaded",
                         headers={"Retry-After": str(self._cfg.http.retry_after_s)})

    async def _start(self, payload: dict[str, Any], request_id: str) -> _Stream:
        """Send a request to a replica and read its first chunk (``start`` or ``error``)."""
        generator = None
        try:
            generator = self._replicas.options(stream=True).generate.remote(payload)
            first = chunk_as_dict(await generator.__anext__())
        except asyncio.CancelledError:  # deadline or client gone before the first chunk: free the replica
            if generator is not None:
                generator.cancel()
            raise
        except StopAsyncIteration:
            raise HTTPError(502, "replica closed the stream without answering") from None
        except Exception as exc:
            if _is_backpressure(exc):
                raise self._overloaded("server overloaded: request queue is full; retry later",
                                       tier=payload.get("tier")) from None
            if _is_replica_failure(exc):
                with _suppress_all():  # no replica answered: an SLO miss the replicas cannot count
                    self._controller.record_rejections.remote(1, payload.get("tier"))
                raise HTTPError(503, f"no replica available: {type(exc).__name__}",
                                headers={"Retry-After": str(self._cfg.http.retry_after_s)}) from None
            logger.exception("replica call failed (request id %s)", request_id)
            raise _internal_error(request_id) from None
        if first.get("type") == "error":
            status = int(first["status"])
            if status == 503:  # the replica already counted this rejection
                raise self._overloaded(first["message"], count=False)
            if status == 422:  # a replica-side value check (tier, bounds, limits): a bad request, as OpenAI says
                status = 400
            raise HTTPError(status, first["message"], first.get("param"), first.get("code"))
        return _Stream(generator, first)

    def _payload(self, body: CompletionRequest | ChatCompletionRequest, request: Request,
                 prompt: Any, chat: bool, arrival_unix: float | None = None) -> dict[str, Any]:
        header_tier = request.headers.get("x-slo-tier")
        tier = body.fsd.tier if body.fsd is not None and body.fsd.tier is not None else header_tier
        threshold = body.fsd.threshold if body.fsd is not None else None
        return {
            "request_id": uuid.uuid4().hex,
            "prompt": prompt,
            "chat": chat,
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stop": body.stop_list(),
            "seed": body.seed,
            "ignore_eos": body.ignore_eos,
            "tier": tier or None,
            "threshold": threshold,
            "arrival_unix": arrival_unix,  # latency counts from here: what the user sees
        }

    # ---- generation ------------------------------------------------------------------------------

    def _log_ignored_fields(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        new = [f for f in body.extra_fields() if f not in self._ignored_fields_logged]
        if new:  # once per field name: vLLM warns about ignored fields too, but a hot loop must not flood
            self._ignored_fields_logged.update(new)
            logger.warning("ignoring unknown request field(s) %s", new)

    async def _generate(self, request: Request, chat: bool) -> Response:
        started = time.monotonic()
        recording: RequestRecording | None = None
        request_id = _request_id(request)
        arrival_unix = time.time()
        try:
            data = await self._json_object(request)
            try:
                check_unsupported(data)
            except UnsupportedParameterError as exc:
                raise HTTPError(400, str(exc), exc.param, "unsupported_parameter") from None
            try:
                body: CompletionRequest | ChatCompletionRequest = (
                    ChatCompletionRequest.model_validate(data) if chat else CompletionRequest.model_validate(data)
                )
            except ValidationError as exc:
                raise _validation_error(exc) from None
            self._check_model(body.model)
            self._log_ignored_fields(body)
            prompt: Any = body.message_dicts() if isinstance(body, ChatCompletionRequest) else body.prompt_text()
            # Plain completions are raw text continuation; chat goes through the chat template.
            payload = self._payload(body, request, prompt, chat=chat, arrival_unix=arrival_unix)
            if self._recorder is not None:
                recording = RequestRecording.for_payload(self._recorder, payload, self._cfg)
            timeout = self._cfg.http.request_timeout_s
            try:
                stream = await asyncio.wait_for(self._start(payload, request_id), timeout)
            except TimeoutError:
                with _suppress_all():  # no replica answered in time: an SLO miss of the request's tier
                    self._controller.record_aborted.remote(1, payload.get("tier"))
                raise HTTPError(504, f"request did not start within {timeout}s") from None
        except HTTPError as err:
            if recording is not None:
                recording.refused(err.status)
            return err.response()
        if recording is not None:
            recording.observe(stream.first)
            stream.recording = recording
        meta = {
            "id": ("chatcmpl-" if chat else "cmpl-") + payload["request_id"],
            "created": int(time.time()),
            "model": self._cfg.model_name,
        }
        deadline = started + self._cfg.http.request_timeout_s
        if body.stream:
            return StreamingResponse(self._sse(stream, meta, chat, deadline, body.include_usage, request_id),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(stream, meta, chat, deadline, request_id)

    async def _collect(self, stream: _Stream, meta: dict[str, Any], chat: bool, deadline: float,
                       request_id: str) -> Response:
        parts: list[str] = []
        end: dict[str, Any] | None = None

        async def consume() -> None:
            nonlocal end
            async for chunk in stream.chunks():
                if chunk.get("text"):
                    parts.append(chunk["text"])
                if chunk["type"] == "end":
                    end = chunk
                    return

        try:
            await asyncio.wait_for(consume(), max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            return HTTPError(504, f"request timed out after {self._cfg.http.request_timeout_s}s").response()
        except Exception as exc:
            if _is_replica_failure(exc):
                return HTTPError(503, f"replica failed while generating: {type(exc).__name__}",
                                 headers={"Retry-After": str(self._cfg.http.retry_after_s)}).response()
            logger.exception("generation failed (request id %s)", request_id)
            return _internal_error(request_id).response()
        if end is None:
            return HTTPError(502, "replica stream ended without a final chunk").response()
        if end["finish_reason"] == "error":
            logger.error("generation failed (request id %s): %s", request_id, end.get("error"))
            return _internal_error(request_id).response()
        text = "".join(parts)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": end["finish_reason"], "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": end["finish_reason"], "logprobs": None}
            obj = "text_completion"
        return JSONResponse({**meta, "object": obj, "choices": [choice], "usage": end["usage"],
                             "fsd": _finite(end["fsd"])})

    async def _sse(self, stream: _Stream, meta: dict[str, Any], chat: bool, deadline: float,
                   include_usage: bool, request_id: str) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        role_sent = False

        def event(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
            body: dict[str, Any] = {**meta, "object": obj, "choices": choices, **(extra or {})}
            if include_usage:  # OpenAI: with include_usage every chunk has `usage`, null until the last
                body.setdefault("usage", None)
            return f"data: {json.dumps(body)}\n\n"

        def choice(text: str, finish: str | None) -> dict[str, Any]:
            nonlocal role_sent
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            delta: dict[str, Any] = {}
            if not role_sent:  # the role rides on the first chunk that has text: no chunk before prefill
                delta["role"] = "assistant"
                role_sent = True
                delta["content"] = text
            elif text:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

        chunks = stream.chunks()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                chunk = await asyncio.wait_for(chunks.__anext__(), remaining)
                if chunk["type"] == "delta":
                    if chunk["text"]:
                        yield event([choice(chunk["text"], None)])
                elif chunk["type"] == "end":
                    if chunk["finish_reason"] == "error":
                        logger.error("generation failed (request id %s): %s", request_id, chunk.get("error"))
                        yield _sse_error(500, _internal_error(request_id).message)
                    else:
                        # The last text and the finish reason travel together, as vLLM sends them.
                        yield event([choice(chunk.get("text") or "", chunk["finish_reason"])],
                                    {"fsd": _finite(chunk["fsd"])})
                        if include_usage:
                            yield event([], {"usage": chunk["usage"]})
                    break
        except StopAsyncIteration:
            yield _sse_error(502, "replica stream ended without a final chunk")
        except TimeoutError:
            yield _sse_error(504, f"request timed out after {self._cfg.http.request_timeout_s}s")
        except Exception as exc:
            if _is_replica_failure(exc):
                yield _sse_error(503, f"replica failed while generating: {type(exc).__name__}")
            else:
                logger.exception("generation failed (request id %s)", request_id)
                yield _sse_error(500, _internal_error(request_id).message)
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _model_card(self) -> dict[str, Any]:
        if self._max_model_len is None:
            try:  # the ingress loads no model: a replica knows the pair's context
                stats = await asyncio.wait_for(self._replicas.stats.remote(drain=False), 10.0)
                self._max_model_len = int(stats["max_context"])
            except Exception:  # no replica yet: answer without it rather than fail the listing
                logger.warning("could not read max_context from a replica", exc_info=True)
        return {"id": self._cfg.model_name, "object": "model", "created": self._created, "owned_by": "fsd-runtime",
                "root": self._cfg.model.pair, "parent": None, "max_model_len": self._max_model_len}

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [await self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str) -> Response:
        try:
            self._check_model(model_id)
        except HTTPError as err:
            return err.response()
        return JSONResponse(await self._model_card())

    # ---- control plane ---------------------------------------------------------------------------

    async def _controller_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(getattr(self._controller, method).remote(*args, **kwargs), 10.0)
        except TimeoutError:
            raise HTTPError(504, "controller did not answer within 10s") from None
        except ValueError as exc:  # the controller's own validation (re-raised through Ray)
            raise HTTPError(400, _cause_message(exc)) from None
        except Exception as exc:
            raise HTTPError(503, f"controller unavailable: {type(exc).__name__}",
                            headers={"Retry-After": str(self._cfg.http.retry_after_s)}) from None

    @app.get("/v1/fsd/status")
    async def status(self, history: int = 50) -> Response:
        try:
            result = await self._controller_call("status", history=max(0, min(history, 10_000)))
        except HTTPError as err:
            return err.response()
        result["shadow_estimate"] = await self._shadow_estimator.estimate(result)
        return JSONResponse(result)

    @app.get("/v1/fsd/recording")
    async def recording(self, request: Request) -> Response:
        """The traffic recording as one trace CSV (admin: it describes every user's traffic)."""
        try:
            self._check_admin(request)
            if self._recorder is None:
                raise HTTPError(404, "traffic recording is off; set recording.enabled: true in the config",
                                code="recording_disabled")
            text = await asyncio.to_thread(self._recorder.read_all)
        except HTTPError as err:
            return err.response()
        return Response(content=text, media_type="text/csv; charset=utf-8")

    @app.post("/v1/fsd/policy/promote")
    async def promote(self, request: Request) -> Response:
        """Make the shadow policy the active one (validated, recorded in the status history)."""
        try:
            self._check_admin(request)
            result = await self._controller_call("promote_shadow")
        except HTTPError as err:
            return err.response()
        return JSONResponse(result)

    @app.put("/v1/fsd/slo")
    async def put_slo(self, request: Request) -> Response:
        from policies.slo import SLOSpec

        try:
            self._check_admin(request)
            data = await self._json_object(request)
            try:
                SLOSpec.model_validate(data)
            except ValidationError as exc:
                raise _validation_error(exc) from None
            result = await self._controller_call("set_slo", data)
        except HTTPError as err:
            return err.response()
        return JSONResponse(result)

    @app.put("/v1/fsd/policy")
    async def put_policy(self, request: Request, shadow: bool = False) -> Response:
        from controller.control_loop import build_policy
        from policies.slo import SLOSpec

        try:
            self._check_admin(request)
            spec = await self._read_json(request)
            if spec is None and not shadow:
                raise HTTPError(400, "policy: a policy spec is required", "policy")
            if spec is not None:
                if not isinstance(spec, dict | str):
                    raise HTTPError(400, f"policy spec must be a name or an object, got {type(spec).__name__}",
                                    "policy")
                current = await self._controller_call("status", history=0)
                try:
                    build_policy(spec, SLOSpec.model_validate(current["slo"]))
                except ValueError as exc:
                    raise HTTPError(400, str(exc), "policy") from None
            result = await self._controller_call("set_policy", spec, shadow=shadow)
        except HTTPError as err:
            return err.response()
        return JSONResponse(result)

    @app.get("/metrics")
    async def metrics(self) -> Response:
        try:
            text = await self._controller_call("metrics_text")
        except HTTPError as err:
            return err.response()
        return Response(content=text, media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/healthz")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "model": self._cfg.model_name}
