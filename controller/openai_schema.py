"""OpenAI-compatible request bodies (typed; unknown fields are accepted and ignored, as OpenAI clients
send many) and the ``fsd`` extension.

Types are strict: ``"max_tokens": "5"`` is a 422, not silently coerced. Every float rejects NaN/inf.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class FSDOptions(BaseModel):
    """The ``fsd`` body field: which SLO tier, and optionally a per-request T within the tier's bounds."""

    model_config = ConfigDict(extra="forbid", strict=True)

    tier: str | None = Field(None, min_length=1)
    threshold: float | None = Field(None, ge=0, allow_inf_nan=False)


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # vLLM's extension: decode exactly max_tokens (load tests, benchmarks)
    stream: bool = False
    n: int = Field(1, ge=1)
    fsd: FSDOptions | None = None

    @field_validator("n")
    @classmethod
    def _single_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"only n=1 is supported, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list):
            if len(v) != 1:
                raise ValueError(f"exactly one prompt per request is supported, got a list of {len(v)}")
            v = v[0]
        if not v:
            raise ValueError("prompt must not be empty")
        return v

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(min_length=1)
    content: str


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _some_content(self) -> ChatCompletionRequest:
        if not any(m.content for m in self.messages):
            raise ValueError("messages: every message content is empty")
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]
