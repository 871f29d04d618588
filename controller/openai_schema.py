"""OpenAI-compatible request bodies, checked the way vLLM's OpenAI server checks them, plus the ``fsd``
extension.

* Types are strict: ``"max_tokens": "5"`` is refused, not silently coerced. Every float rejects NaN/inf.
* Chat ``content`` is a string, a list of text parts (``[{"type": "text", "text": "…"}]``, joined with
  newlines as vLLM does), or ``null`` on an assistant message (tool-call history). Other part types
  (images, audio) are refused naming the part.
* Roles are ``system``, ``user``, ``assistant``, ``tool``, ``developer``.
* OpenAI parameters this server does not implement (``n > 1``, ``logprobs``, ``tools``, penalties…) are
  refused with the parameter's name when set to anything but their neutral value — see
  :data:`UNSUPPORTED_PARAMETERS`. Other unknown fields are ignored (clients send many), as vLLM does.

Every refusal surfaces as HTTP 400 with OpenAI's error body (``controller.api``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: Roles a chat message may have (OpenAI's, as vLLM accepts them).
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

#: OpenAI request parameters this server does not implement, with the values that mean "off": a request
#: setting one to anything else gets a 400 naming it instead of a silently different answer.
UNSUPPORTED_PARAMETERS: dict[str, tuple[Any, ...]] = {
    "n": (1, None),
    "best_of": (1, None),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (False, None),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "prompt_logprobs": (None,),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "min_tokens": (None, 0),
}

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class UnsupportedParameterError(ValueError):
    """A known OpenAI parameter set to a value this server does not implement."""

    def __init__(self, param: str, value: Any) -> None:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        hint = "only n=1 is supported" if param == "n" else "not supported by this server"
        super().__init__(f"{param}: {hint} (got {shown}); remove it or send its default")
        self.param = param


def check_unsupported(data: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedParameterError` for the first unsupported parameter that is switched on."""
    for param, neutral in UNSUPPORTED_PARAMETERS.items():
        if param in data:
            value = data[param]
            # bool is an int: `logprobs: false` must not match the neutral 0 of another parameter and v.v.
            if not any(type(value) is type(n) and value == n for n in neutral if n is not None) and value is not None:
                raise UnsupportedParameterError(param, value)


class FSDOptions(BaseModel):
    """The ``fsd`` body field: which SLO tier, and optionally a per-request T within the tier's bounds."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tier: str | None = Field(None, min_length=1)
    threshold: float | None = Field(None, ge=0, allow_inf_nan=False)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with ``choices: []`` and the usage."""

    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="0 or -1 (vLLM's spelling) = off")
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    ignore_eos: bool = False  # vLLM's extension: decode exactly max_tokens (load tests, benchmarks)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    fsd: FSDOptions | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, v: Any) -> Any:
        # One clear message instead of pydantic's per-branch union errors ("stop.str: …; stop.list[str]: …").
        if v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(s, str) for s in v)):
            return v
        raise ValueError(f"must be a string or a list of strings, got {type(v).__name__}")

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int) -> int:
        return 0 if v == -1 else v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def extra_fields(self) -> list[str]:
        """Unknown fields that were ignored (logged by the ingress, as vLLM does)."""
        return sorted(self.model_extra or {})


class CompletionRequest(_Common):
    prompt: str

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text_prompt(cls, v: Any) -> Any:
        if isinstance(v, list):
            if v and all(isinstance(t, int) for t in v):
                raise ValueError("token-id prompts are not supported; send the prompt as text")
            if len(v) != 1:
                raise ValueError(f"exactly one prompt per request is supported, got a list of {len(v)}")
            v = v[0]
            if not isinstance(v, str):
                raise ValueError(f"must be text; token-id prompts are not supported (got a {type(v).__name__})")
        if isinstance(v, str) and not v:
            raise ValueError("must not be empty")
        return v

    def prompt_text(self) -> str:
        return self.prompt


def _joined_text_parts(parts: list[Any]) -> str:
    texts = []
    for i, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ValueError(f"content part {i} must be an object, got {type(part).__name__}")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"content part {i} has type {kind!r}; only 'text' parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise ValueError(f"content part {i}: 'text' must be a string, got {type(text).__name__}")
        texts.append(text)
    return "\n".join(texts)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        return _joined_text_parts(v) if isinstance(v, list) else v

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # An assistant turn that only made tool calls has `content: null`; every other role needs content.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: required for a {self.role!r} message")
        return self


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _some_content(self) -> ChatCompletionRequest:
        if not any(m.content for m in self.messages):
            raise ValueError("messages: every message content is empty")
        # OpenAI deprecates max_tokens for max_completion_tokens; vLLM lets the newer one win.
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.content or ""} for m in self.messages]
