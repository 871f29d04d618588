"""One streamed OpenAI-style request, timed at the client: the load and fidelity benchmarks' probe.

TTFT = first content chunk − send, TPOT = (last − first content chunk) / (completion tokens − 1),
E2E = end of stream − send; token counts come from the final usage chunk (``stream_options.include_usage``
is set here), the ``fsd`` block from the finish chunk.
"""

from __future__ import annotations

import json
import time
from typing import Any


async def timed_stream(client: Any, path: str, body: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    """POST ``body`` (with ``"stream": true``) to ``path`` on an ``httpx.AsyncClient``; fills ``rec``
    with ``status``, ``e2e_ms``, ``ttft_ms``, ``tpot_ms``, ``prompt_tokens``, ``output_tokens`` and
    ``fsd``. A non-200 status, an error chunk or a transport error is recorded in ``status``, never raised."""
    sent = time.monotonic()
    first = last = None
    try:
        body = {**body, "stream_options": {"include_usage": True}}
        async with client.stream("POST", path, json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec["status"] = chunk["error"].get("code", 500)
                    continue
                now = time.monotonic()
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    first = first or now
                    last = now
                if chunk.get("usage"):
                    rec["prompt_tokens"] = chunk["usage"]["prompt_tokens"]
                    rec["output_tokens"] = chunk["usage"]["completion_tokens"]
                if chunk.get("fsd"):
                    rec["fsd"] = chunk["fsd"]
    except Exception as exc:  # recorded, never hidden
        rec["status"] = type(exc).__name__
        return rec
    rec["e2e_ms"] = (time.monotonic() - sent) * 1e3
    if first is not None:
        rec["ttft_ms"] = (first - sent) * 1e3
        n = rec.get("output_tokens", 0)
        rec["tpot_ms"] = (last - first) * 1e3 / (n - 1) if n > 1 and last is not None else None
    return rec
