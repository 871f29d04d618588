"""The benchmarks' streaming probe against an in-process ASGI server speaking our SSE format."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.sse_client import timed_stream  # noqa: E402


def _sse(chunks: list[dict]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def _app(status: int, body: bytes):
    async def app(scope, receive, send):  # minimal ASGI: one fixed streamed response
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for line in body.split(b"\n\n"):
            if line:
                await send({"type": "http.response.body", "body": line + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def _run(status: int, body: bytes) -> dict:
    async def go() -> dict:
        transport = httpx.ASGITransport(app=_app(status, body))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await timed_stream(client, "/v1/chat/completions", {"stream": True}, {"i": 0})

    return asyncio.run(go())


def test_chat_stream_yields_tokens_and_timings() -> None:
    delta = {"choices": [{"delta": {"content": "x"}}]}
    usage = {"choices": [{"delta": {}}], "usage": {"prompt_tokens": 7, "completion_tokens": 3},
             "fsd": {"tier": "standard", "threshold": 0.5}}
    rec = _run(200, _sse([delta, delta, delta, usage]))
    assert rec["status"] == 200
    assert rec["prompt_tokens"] == 7 and rec["output_tokens"] == 3 and rec["fsd"]["threshold"] == 0.5
    # (httpx's ASGI transport delivers the body at once, so only the ordering of the times is checked)
    assert 0 < rec["ttft_ms"] <= rec["e2e_ms"]
    assert rec["tpot_ms"] is not None and 0 <= rec["tpot_ms"] <= rec["e2e_ms"]


def test_completion_text_chunks_count_as_content() -> None:
    text = {"choices": [{"text": "y"}]}
    rec = _run(200, _sse([text, {"choices": [{"text": ""}], "usage": {"prompt_tokens": 2, "completion_tokens": 1}}]))
    assert rec["output_tokens"] == 1 and rec["ttft_ms"] > 0 and rec["tpot_ms"] is None


def test_errors_are_recorded_not_raised() -> None:
    assert _run(503, b'{"error": "busy"}')["status"] == 503
    rec = _run(200, _sse([{"error": {"code": 504, "message": "deadline"}}]))
    assert rec["status"] == 504 and "ttft_ms" not in rec
