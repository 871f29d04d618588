"""Request schema and the ingress's last-resort error handling, without Ray (fast)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from controller.openai_schema import (
    UNSUPPORTED_PARAMETERS,
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedParameterError,
    check_unsupported,
)


def chat(**overrides: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **overrides}


def test_text_parts_join_with_newlines_like_vllm() -> None:
    body = ChatCompletionRequest.model_validate(chat(messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]))
    assert body.message_dicts() == [{"role": "user", "content": "a\nb"}]


def test_null_content_only_on_assistant_messages() -> None:
    body = ChatCompletionRequest.model_validate(chat(messages=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": []}]))
    assert body.message_dicts()[1] == {"role": "assistant", "content": ""}
    with pytest.raises(ValidationError, match="required for a 'user' message"):
        ChatCompletionRequest.model_validate(chat(messages=[{"role": "user", "content": None}]))


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool", "developer"])
def test_openai_roles_accepted(role: str) -> None:
    assert ChatCompletionRequest.model_validate(chat(messages=[{"role": role, "content": "x"}]))


@pytest.mark.parametrize("role", ["wizard", "", "USER", "function"])
def test_other_roles_refused(role: str) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(chat(messages=[{"role": role, "content": "x"}]))
    assert e.value.errors()[0]["loc"] == ("messages", 0, "role")


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert ChatCompletionRequest.model_validate(chat(max_tokens=9, max_completion_tokens=5)).max_tokens == 5
    assert ChatCompletionRequest.model_validate(chat(max_tokens=9)).max_tokens == 9


def test_top_k_minus_one_means_off() -> None:
    assert CompletionRequest.model_validate({"prompt": "x", "top_k": -1}).top_k == 0


def test_stream_options_need_stream() -> None:
    with pytest.raises(ValidationError, match="stream_options"):
        CompletionRequest.model_validate({"prompt": "x", "stream_options": {"include_usage": True}})
    body = CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert body.include_usage


def test_unknown_fields_are_ignored_but_listed() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "metadata": {"a": 1}, "store": False})
    assert body.extra_fields() == ["metadata", "store"]


@pytest.mark.parametrize("param", sorted(UNSUPPORTED_PARAMETERS))
def test_unsupported_parameters_pass_at_neutral_values_and_fail_otherwise(param: str) -> None:
    for neutral in UNSUPPORTED_PARAMETERS[param]:
        check_unsupported({param: neutral})
    switched_on = {"n": 2, "best_of": 2, "logprobs": True, "top_logprobs": 2, "echo": True, "suffix": "s",
                   "logit_bias": {"1": 5}, "frequency_penalty": 0.5, "presence_penalty": -1,
                   "repetition_penalty": 1.2, "tools": [{"type": "function"}], "tool_choice": "required",
                   "functions": [{"name": "f"}], "function_call": {"name": "f"},
                   "response_format": {"type": "json_object"}, "modalities": ["text", "audio"],
                   "min_tokens": 3}.get(param, {"x": 1})
    with pytest.raises(UnsupportedParameterError) as e:
        check_unsupported({param: switched_on})
    assert e.value.param == param and param in str(e.value)


def test_bool_is_not_a_neutral_number() -> None:
    # `n: true` is not `n: 1`, and `logprobs: 0` is not `logprobs: false` (it asks for log-probs in completions).
    with pytest.raises(UnsupportedParameterError):
        check_unsupported({"n": True})
    with pytest.raises(UnsupportedParameterError):
        check_unsupported({"logprobs": 0})


# ---- the ingress app's last-resort handler ---------------------------------------------------------


def test_unhandled_exception_is_openai_500_without_traceback() -> None:
    from controller.api import _UnhandledErrorMiddleware

    async def broken_app(scope: Any, receive: Any, send: Any) -> None:
        raise RuntimeError("secret /home/user/path at 10.0.0.7")

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=_UnhandledErrorMiddleware(broken_app))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/completions", headers={"x-request-id": "rid-42"})

    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    serve_logger = logging.getLogger("ray.serve")  # Serve's logger does not propagate to the root
    serve_logger.addHandler(handler)
    try:
        r = asyncio.run(call())
    finally:
        serve_logger.removeHandler(handler)
    assert r.status_code == 500
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert "rid-42" in error["message"]
    assert "secret" not in r.text and "Traceback" not in r.text
    assert any("rid-42" in rec.getMessage() and rec.exc_info for rec in records), "logged with its id"
