"""The official ``openai`` client against the running service, and a corpus of malformed requests.

The client is what users, LangChain and ``vllm bench serve --backend openai-chat`` put in front of an
OpenAI-compatible server: if it parses our answers (and our errors) unchanged, they do too. Equality
checks run on the lossless tier (T = 0) with a seed and a pinned draft length: a seeded request is
reproducible for the same T and k, and the shipped SLO policy may change k between two calls (it did, in CI).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai  # a dev dependency: a missing client must fail the suite, not skip it
import pytest

from tests.controller.conftest import ADMIN_TOKEN, RayServe, deployed_app, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

APP = "fsd-openai-test"
MODEL = "tiny"
LOSSLESS = {"fsd": {"tier": "lossless"}}
# A static policy: T = 0 and k = 4 for every tier, so the seeded equality checks below cannot depend on
# when the controller last moved k.
PINNED_POLICY = {"policy": "static", "thresholds": 0.0, "draft_lengths": 4}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def service(ray_serve: RayServe) -> Iterator[str]:
    with deployed_app(ray_serve, tiny_config(control={"policy": PINNED_POLICY}), APP) as url:
        yield url


@pytest.fixture(scope="module")
def oai(service: str) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{service}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture
def http(service: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service, timeout=60) as c:
        yield c


# ---- the official client -------------------------------------------------------------------------


def test_completion(oai: Any) -> None:
    r = oai.completions.create(model=MODEL, prompt="hello world", max_tokens=8, seed=1)
    assert r.object == "text_completion" and r.model == MODEL
    assert isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["fsd"]["tier"] == "standard"  # the extension survives the client's parsing


def test_chat_string_and_text_part_content_are_the_same_prompt(oai: Any) -> None:
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "temperature": 0.9, "seed": 5, "extra_body": LOSSLESS}
    plain = oai.chat.completions.create(messages=[{"role": "user", "content": "tell me a story"}], **common)
    parts = oai.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "tell me a story"}]}], **common)
    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant"
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    # Two parts join with a newline (as vLLM joins them): a different prompt, one token longer at least.
    two = oai.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "tell me"}, {"type": "text", "text": "a story"}]}],
        **common)
    assert two.usage.prompt_tokens >= plain.usage.prompt_tokens


def test_chat_history_with_every_role_and_null_assistant_content(oai: Any) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": "you are terse"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "user", "content": "so?"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_with_usage_matches_non_stream(oai: Any) -> None:
    common: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "count to ten"}],
                              "max_tokens": 16, "temperature": 0.8, "seed": 11, "extra_body": LOSSLESS}
    plain = oai.chat.completions.create(**common)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **common))
    content_chunks = [c for c in chunks if c.choices]
    # The first chunk carries the first token (and the role): no empty chunk before prefill.
    assert content_chunks[0].choices[0].delta.role == "assistant"
    assert content_chunks[0].choices[0].delta.content
    assert content_chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.usage is None for c in content_chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == plain.choices[0].message.content


def test_completion_stream_with_usage(oai: Any) -> None:
    common: dict[str, Any] = {"model": MODEL, "prompt": "once upon", "max_tokens": 10, "seed": 3,
                              "extra_body": LOSSLESS}
    plain = oai.completions.create(**common)
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **common))
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    # Without include_usage there is no usage chunk (OpenAI's behaviour): every chunk has a choice.
    bare = list(oai.completions.create(stream=True, **common))
    assert all(c.choices for c in bare) and all(c.usage is None for c in bare)


def test_stop_list_seed_and_user(oai: Any) -> None:
    common: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "list things"}],
                              "max_tokens": 30, "temperature": 1.0, "seed": 21, "user": "alice",
                              "extra_body": {**LOSSLESS, "ignore_eos": True}}
    free = oai.chat.completions.create(**common).choices[0].message.content
    assert len(free) >= 4, "the seeded free-running answer must be long enough for this test to bite"
    stop = free[len(free) // 2:][:2].strip() or free[-1]
    stopped = oai.chat.completions.create(stop=[stop, "\u2603never"], **common)
    text = stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"
    assert text == free[:free.index(stop)], "generation ends right before the first stop string"
    again = oai.chat.completions.create(stop=[stop, "\u2603never"], **common)
    assert again.choices[0].message.content == text, "same seed, same tier: same answer"


def test_max_completion_tokens(oai: Any) -> None:
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                    max_completion_tokens=7, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    # max_completion_tokens wins over the deprecated max_tokens (vLLM's rule).
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                    max_completion_tokens=5, max_tokens=9, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_models_list_and_retrieve(oai: Any) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = models[0]
    assert card.object == "model" and card.created > 1_600_000_000
    assert card.model_extra["max_model_len"] > 0
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4")


def test_error_shapes_through_the_client(oai: Any) -> None:
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert e.value.status_code == 400 and e.value.param == "max_tokens" and "max_tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])  # type: ignore[misc]
    assert e.value.param == "messages.0.role"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs, n=2)
    assert e.value.param == "n" and e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs, logprobs=True, top_logprobs=2)
    assert e.value.code == "unsupported_parameter" and e.value.param in ("logprobs", "top_logprobs")
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "json_object"})
    assert e.value.param == "response_format"
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4", messages=msgs)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=msgs, stream=True, max_tokens=0)
    assert e.value.param == "max_tokens"


def test_request_id_is_echoed_or_generated(oai: Any) -> None:
    msgs = [{"role": "user", "content": "x"}]
    raw = oai.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=2,
                                                        extra_headers={"X-Request-Id": "req-abc-123"})
    assert raw.headers.get_list("x-request-id") == ["req-abc-123"]
    raw = oai.chat.completions.with_raw_response.create(model=MODEL, messages=msgs, max_tokens=2)
    assert len(raw.headers.get_list("x-request-id")) == 1 and raw.headers["x-request-id"]


# ---- malformed requests: every one a 4xx in OpenAI's error shape, and the server stays up ----------

AUTH = {"authorization": f"Bearer {ADMIN_TOKEN}"}
DEEP_ARRAY = b"[" * 5000 + b"]" * 5000
DEEP_FIELD = b'{"prompt": "x", "extra": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}"
HUGE_INT = b'{"prompt": "x", "seed": 1' + b"0" * 5000 + b"}"


def _c(**body: Any) -> bytes:
    return json.dumps(body).encode()


def _chat(messages: Any = None, **body: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}] if messages is None else messages,
                       **body}).encode()


C, CHAT = "/v1/completions", "/v1/chat/completions"
# (method, path, raw body, extra headers, status, text in the message or the param)
MALFORMED: list[tuple[str, str, bytes | None, dict[str, str], int, str]] = [
    ("POST", C, b"{not json", {}, 400, "malformed JSON"),
    ("POST", C, b"\xff\xfe\x00bad", {}, 400, "UTF-8"),
    ("POST", C, b"[1, 2]", {}, 400, "JSON object"),
    ("POST", C, b"null", {}, 400, "JSON object"),
    ("POST", C, b'"a string"', {}, 400, "JSON object"),
    ("POST", C, b"", {}, 400, "empty"),
    ("POST", C, DEEP_ARRAY, {}, 400, "nested too deeply"),
    ("POST", C, DEEP_FIELD, {}, 400, "nested too deeply"),
    ("POST", C, HUGE_INT, {}, 400, "malformed JSON"),
    ("POST", C, _c(max_tokens=3), {}, 400, "prompt"),
    ("POST", C, _c(prompt=""), {}, 400, "prompt"),
    ("POST", C, _c(prompt=[]), {}, 400, "prompt"),
    ("POST", C, _c(prompt=["a", "b"]), {}, 400, "prompt"),
    ("POST", C, _c(prompt=[1, 2, 3]), {}, 400, "token-id"),
    ("POST", C, _c(prompt=5), {}, 400, "prompt"),
    ("POST", C, _c(prompt=None), {}, 400, "prompt"),
    ("POST", C, _c(prompt="x", max_tokens=0), {}, 400, "max_tokens"),
    ("POST", C, _c(prompt="x", max_tokens=-1), {}, 400, "max_tokens"),
    ("POST", C, _c(prompt="x", max_tokens=1.5), {}, 400, "max_tokens"),
    ("POST", C, _c(prompt="x", max_tokens="5"), {}, 400, "max_tokens"),
    ("POST", C, _c(prompt="x", max_tokens=True), {}, 400, "max_tokens"),
    ("POST", C, _c(prompt="x", max_tokens=10**9), {}, 400, "max_tokens"),
    ("POST", C, _c(prompt="x", temperature=-0.1), {}, 400, "temperature"),
    ("POST", C, _c(prompt="x", temperature=2.5), {}, 400, "temperature"),
    ("POST", C, b'{"prompt": "x", "temperature": NaN}', {}, 400, "temperature"),
    ("POST", C, b'{"prompt": "x", "temperature": Infinity}', {}, 400, "temperature"),
    ("POST", C, _c(prompt="x", temperature="hot"), {}, 400, "temperature"),
    ("POST", C, _c(prompt="x", top_p=0), {}, 400, "top_p"),
    ("POST", C, _c(prompt="x", top_p=1.5), {}, 400, "top_p"),
    ("POST", C, _c(prompt="x", top_k=-2), {}, 400, "top_k"),
    ("POST", C, _c(prompt="x", top_k=1.5), {}, 400, "top_k"),
    ("POST", C, _c(prompt="x", stop=5), {}, 400, "stop"),
    ("POST", C, _c(prompt="x", stop=["a", "b", "c", "d", "e"]), {}, 400, "stop"),
    ("POST", C, _c(prompt="x", stop=[""]), {}, 400, "stop"),
    ("POST", C, _c(prompt="x", stop=[1]), {}, 400, "stop"),
    ("POST", C, _c(prompt="x", seed="1"), {}, 400, "seed"),
    ("POST", C, _c(prompt="x", seed=2**70), {}, 400, "seed"),
    ("POST", C, _c(prompt="x", stream="yes"), {}, 400, "stream"),
    ("POST", C, _c(prompt="x", stream_options={"include_usage": True}), {}, 400, "stream_options"),
    ("POST", C, _c(prompt="x", stream=True, stream_options={"include_usage": "yes"}), {}, 400, "include_usage"),
    ("POST", C, _c(prompt="x", ignore_eos="yes"), {}, 400, "ignore_eos"),
    ("POST", C, _c(prompt="x", n=2), {}, 400, "n"),
    ("POST", C, _c(prompt="x", best_of=3), {}, 400, "best_of"),
    ("POST", C, _c(prompt="x", logprobs=5), {}, 400, "logprobs"),
    ("POST", C, _c(prompt="x", echo=True), {}, 400, "echo"),
    ("POST", C, _c(prompt="x", suffix="end"), {}, 400, "suffix"),
    ("POST", C, _c(prompt="x", logit_bias={"50256": -100}), {}, 400, "logit_bias"),
    ("POST", C, _c(prompt="x", frequency_penalty=0.5), {}, 400, "frequency_penalty"),
    ("POST", C, _c(prompt="x", presence_penalty=1), {}, 400, "presence_penalty"),
    ("POST", C, _c(prompt="x", model="gpt-4"), {}, 404, "gpt-4"),
    ("POST", C, _c(prompt="x", fsd={"tier": "gold"}), {}, 400, "gold"),
    ("POST", C, b'{"prompt": "x", "fsd": {"threshold": NaN}}', {}, 400, "fsd.threshold"),
    ("POST", C, _c(prompt="x", fsd={"bogus": 1}), {}, 400, "fsd.bogus"),
    ("POST", C, _c(prompt="x", fsd="economy"), {}, 400, "fsd"),
    ("POST", C, _c(prompt="x"), {"x-slo-tier": "platinum"}, 400, "platinum"),
    ("POST", C, _c(prompt="x" * 600, max_tokens=8), {}, 400, "context"),
    ("POST", CHAT, _c(max_tokens=3), {}, 400, "messages"),
    ("POST", CHAT, _chat([]), {}, 400, "messages"),
    ("POST", CHAT, _chat("hi"), {}, 400, "messages"),
    ("POST", CHAT, _chat([1]), {}, 400, "messages.0"),
    ("POST", CHAT, _chat([{"role": "wizard", "content": "x"}]), {}, 400, "messages.0.role"),
    ("POST", CHAT, _chat([{"content": "x"}]), {}, 400, "messages.0.role"),
    ("POST", CHAT, _chat([{"role": "user"}]), {}, 400, "content"),
    ("POST", CHAT, _chat([{"role": "user", "content": None}]), {}, 400, "content"),
    ("POST", CHAT, _chat([{"role": "user", "content": 5}]), {}, 400, "messages.0.content"),
    ("POST", CHAT, _chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://a"}}]}]),
     {}, 400, "only 'text' parts"),
    ("POST", CHAT, _chat([{"role": "user", "content": [{"type": "text"}]}]), {}, 400, "'text' must be a string"),
    ("POST", CHAT, _chat([{"role": "user", "content": [{"type": "text", "text": 5}]}]), {}, 400, "'text' must be"),
    ("POST", CHAT, _chat([{"role": "user", "content": ["hi"]}]), {}, 400, "must be an object"),
    ("POST", CHAT, _chat([{"role": "user", "content": ""}]), {}, 400, "empty"),
    ("POST", CHAT, _chat(tools=[{"type": "function", "function": {"name": "f"}}]), {}, 400, "tools"),
    ("POST", CHAT, _chat(tool_choice="required"), {}, 400, "tool_choice"),
    ("POST", CHAT, _chat(response_format={"type": "json_object"}), {}, 400, "response_format"),
    ("POST", CHAT, _chat(logprobs=True), {}, 400, "logprobs"),
    ("POST", CHAT, _chat(top_logprobs=3), {}, 400, "top_logprobs"),
    ("POST", CHAT, _chat(n=2), {}, 400, "n"),
    ("POST", CHAT, _chat(max_completion_tokens=0), {}, 400, "max_completion_tokens"),
    ("POST", CHAT, _chat(max_completion_tokens="7"), {}, 400, "max_completion_tokens"),
    ("POST", CHAT, DEEP_ARRAY, {}, 400, "nested too deeply"),
    ("POST", C, b'{"prompt": "' + b"y" * 70_000 + b'"}', {}, 413, "exceeds the limit"),
    ("GET", "/v1/nonexistent", None, {}, 404, "no route"),
    ("POST", "/v1/embeddings", _c(input="x"), {}, 404, "no route"),
    ("GET", C, None, {}, 405, "not allowed"),
    ("DELETE", CHAT, None, {}, 405, "not allowed"),
    ("GET", "/v1/fsd/status?history=abc", None, {}, 400, "history"),
    ("GET", "/v1/models/gpt-4", None, {}, 404, "gpt-4"),
    ("PUT", "/v1/fsd/slo", _c(tiers={}), {}, 401, "Bearer"),
    ("PUT", "/v1/fsd/slo", _c(tiers={}), {"authorization": "Bearer wrong"}, 403, "invalid admin token"),
    ("PUT", "/v1/fsd/slo", _c(tiers={"standard": {"tpot_ms": -1}}, default_tier="standard"), AUTH, 400,
     "tiers.standard.tpot_ms"),
    ("PUT", "/v1/fsd/policy", DEEP_ARRAY, AUTH, 400, "nested too deeply"),
    ("PUT", "/v1/fsd/policy?shadow=maybe", _c(policy="pid"), AUTH, 400, "shadow"),
    ("PUT", "/v1/fsd/policy", _c(policy="nonesuch"), AUTH, 400, "unknown policy"),
]


def test_malformed_corpus_is_large_enough() -> None:
    assert len(MALFORMED) >= 50


@pytest.mark.parametrize(("method", "path", "raw", "headers", "status", "needle"), MALFORMED,
                         ids=[f"{i}-{c[0]}-{c[4]}-{c[5][:24]}" for i, c in enumerate(MALFORMED)])
def test_malformed_request_gets_openai_error(http: httpx.Client, method: str, path: str, raw: bytes | None,
                                             headers: dict[str, str], status: int, needle: str) -> None:
    r = http.request(method, path, content=raw, headers={"content-type": "application/json", **headers})
    assert r.status_code == status, r.text[:500]
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    assert needle in error["message"] or needle == error["param"], error
    assert "Traceback" not in r.text and 'File "' not in r.text


def test_server_still_serves_after_the_corpus(http: httpx.Client) -> None:
    for method, path, raw, headers, _, _ in MALFORMED[:10]:
        http.request(method, path, content=raw, headers={"content-type": "application/json", **headers})
    ok = http.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 4})
    assert ok.status_code == 200, ok.text
    assert http.get("/healthz").status_code == 200
