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
``GET /metrics`` (Prometheus text), ``GET /healthz``, ``GET /v1/models``.

Status codes (errors are OpenAI-shaped ``{"error": {"message", "type", "param", "code"}}``, the message
names the field):

=====  ===================================================================================================
400    body is not UTF-8, not JSON, or not a JSON object; prompt + max_tokens over the model's context
401    admin call without a bearer token;  403: wrong token, or no admin token configured
404    unknown ``model``
413    body larger than ``http.max_body_bytes``
422    a field with a wrong type or value: NaN/inf, ``max_tokens`` ≤ 0 or above the limit, empty prompt,
       unknown tier, T outside the tier's bounds, invalid SLO or policy spec
503    overload (replica queue or Serve's queue full) or no replica available — with ``Retry-After``
504    the request did not finish within ``http.request_timeout_s``
=====  ===================================================================================================
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
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from controller.config import FSDConfig, format_validation_error, parse_config
from controller.openai_schema import ChatCompletionRequest, CompletionRequest
from controller.protocol import chunk_as_dict

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
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    return HTTPError(422, format_validation_error(exc), param)


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

    async def chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        try:
            async for typed in self.generator:
                chunk = chunk_as_dict(typed)  # typed across the Ray boundary; rendered from the JSON view
                yield chunk
                if chunk.get("type") == "end":
                    self.done = True
        finally:
            if not self.done:
                self.generator.cancel()


def _sse_error(status: int, message: str) -> str:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return f"data: {json.dumps({'error': {'message': message, 'type': kind, 'code': status}})}\n\n"


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

    async def _start(self, payload: dict[str, Any]) -> _Stream:
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
            logger.exception("replica call failed")
            raise HTTPError(500, f"replica error: {type(exc).__name__}: {exc}") from None
        if first.get("type") == "error":
            status = int(first["status"])
            if status == 503:  # the replica already counted this rejection
                raise self._overloaded(first["message"], count=False)
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

    async def _generate(self, request: Request, chat: bool) -> Response:
        started = time.monotonic()
        arrival_unix = time.time()
        try:
            data = await self._json_object(request)
            try:
                body: CompletionRequest | ChatCompletionRequest = (
                    ChatCompletionRequest.model_validate(data) if chat else CompletionRequest.model_validate(data)
                )
            except ValidationError as exc:
                raise _validation_error(exc) from None
            self._check_model(body.model)
            prompt: Any = body.message_dicts() if isinstance(body, ChatCompletionRequest) else body.prompt_text()
            # Plain completions are raw text continuation; chat goes through the chat template.
            payload = self._payload(body, request, prompt, chat=chat, arrival_unix=arrival_unix)
            timeout = self._cfg.http.request_timeout_s
            try:
                stream = await asyncio.wait_for(self._start(payload), timeout)
            except TimeoutError:
                with _suppress_all():  # no replica answered in time: an SLO miss of the request's tier
                    self._controller.record_aborted.remote(1, payload.get("tier"))
                raise HTTPError(504, f"request did not start within {timeout}s") from None
        except HTTPError as err:
            return err.response()
        meta = {
            "id": ("chatcmpl-" if chat else "cmpl-") + payload["request_id"],
            "created": int(time.time()),
            "model": self._cfg.model_name,
        }
        deadline = started + self._cfg.http.request_timeout_s
        if body.stream:
            return StreamingResponse(self._sse(stream, meta, chat, deadline), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._collect(stream, meta, chat, deadline)

    async def _collect(self, stream: _Stream, meta: dict[str, Any], chat: bool, deadline: float) -> Response:
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
            logger.exception("generation failed")
            return HTTPError(500, f"generation failed: {type(exc).__name__}: {exc}").response()
        if end is None:
            return HTTPError(502, "replica stream ended without a final chunk").response()
        if end["finish_reason"] == "error":
            return HTTPError(500, f"generation failed: {end.get('error')}").response()
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

    async def _sse(self, stream: _Stream, meta: dict[str, Any], chat: bool, deadline: float) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(delta_text: str | None, finish: str | None, extra: dict[str, Any] | None = None,
                  role: bool = False) -> str:
            if chat:
                delta: dict[str, Any] = {"role": "assistant"} if role else {}
                if delta_text:
                    delta["content"] = delta_text
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "finish_reason": finish}
            return f"data: {json.dumps({**meta, 'object': obj, 'choices': [choice], **(extra or {})})}\n\n"

        if chat:
            yield event(None, None, role=True)
        chunks = stream.chunks()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                chunk = await asyncio.wait_for(chunks.__anext__(), remaining)
                if chunk["type"] == "delta":
                    yield event(chunk["text"], None)
                elif chunk["type"] == "end":
                    if chunk["finish_reason"] == "error":
                        yield _sse_error(500, f"generation failed: {chunk.get('error')}")
                    else:
                        if chunk.get("text"):
                            yield event(chunk["text"], None)
                        yield event(None, chunk["finish_reason"],
                                    {"usage": chunk["usage"], "fsd": _finite(chunk["fsd"])})
                    break
        except StopAsyncIteration:
            yield _sse_error(502, "replica stream ended without a final chunk")
        except TimeoutError:
            yield _sse_error(504, f"request timed out after {self._cfg.http.request_timeout_s}s")
        except Exception as exc:
            status = 503 if _is_replica_failure(exc) else 500
            yield _sse_error(status, f"generation failed: {type(exc).__name__}")
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self._cfg.model_name, "object": "model", "owned_by": "fsd-runtime"}]}

    # ---- control plane ---------------------------------------------------------------------------

    async def _controller_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.wait_for(getattr(self._controller, method).remote(*args, **kwargs), 10.0)
        except TimeoutError:
            raise HTTPError(504, "controller did not answer within 10s") from None
        except ValueError as exc:  # the controller's own validation (re-raised through Ray)
            raise HTTPError(422, _cause_message(exc)) from None
        except Exception as exc:
            raise HTTPError(503, f"controller unavailable: {type(exc).__name__}",
                            headers={"Retry-After": str(self._cfg.http.retry_after_s)}) from None

    @app.get("/v1/fsd/status")
    async def status(self, history: int = 50) -> Response:
        try:
            result = await self._controller_call("status", history=max(0, min(history, 10_000)))
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
                raise HTTPError(422, "policy: a policy spec is required", "policy")
            if spec is not None:
                if not isinstance(spec, dict | str):
                    raise HTTPError(422, f"policy spec must be a name or an object, got {type(spec).__name__}",
                                    "policy")
                current = await self._controller_call("status", history=0)
                try:
                    build_policy(spec, SLOSpec.model_validate(current["slo"]))
                except ValueError as exc:
                    raise HTTPError(422, str(exc), "policy") from None
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
