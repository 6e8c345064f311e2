"""Request models of the HTTP server (pydantic 2), with their bounds in ``Field``.

Policy on parameters (documented in the server's module docstring too):

- Every model forbids unknown fields: a typo such as ``max_token`` or an unsupported feature
  (``tools``, ``response_format``, ``logit_bias`` with entries ...) gets a 400 in the OpenAI error
  shape, never a silent default.
- Standard OpenAI fields that real clients send are accepted when they ask for nothing we would
  have to fake: ``model`` (any value; the server serves one model), ``user``, ``stream_options``,
  ``n``/``best_of`` = 1, ``logprobs`` = null/false (and ``top_logprobs`` null/0), ``echo`` = false,
  ``presence_penalty``/``frequency_penalty`` = 0, ``logit_bias`` = null/{}, ``suffix`` = null,
  ``service_tier``/``metadata``/``store`` (ignored). Any other value of these is a 400 naming the
  parameter.
- llama.cpp extensions accepted on the OpenAI endpoints, as llama-server does: ``top_k``,
  ``min_p``; plus ours: ``n_draft_max`` (drafts verified per cycle, llama-server's
  ``speculative.n_max``) and ``use_drafter``.
- Sampling defaults follow llama-cpp-python / llama-server: temperature 0.8, top_k 40,
  top_p 0.95, min_p 0.05, random seed. OpenAI's ``max_tokens`` default is 16 for
  ``/v1/completions``; for chat, and for ``/completion`` with ``n_predict`` -1, generation runs
  until an end-of-generation token or the context is full.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "StreamOptions", "ChatMessage", "CompletionRequest", "ChatCompletionRequest",
    "LlamaCompletionRequest", "SamplingFields",
]

#: Upper bound on stop strings per request (OpenAI allows 4; llama-server has no bound).
MAX_STOP = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """OpenAI ``stream_options``: ``include_usage`` adds a final chunk with ``usage``."""

    include_usage: bool = False


def _stop_list(v: Union[str, List[str], None]) -> List[str]:
    if v is None:
        return []
    return [v] if isinstance(v, str) else list(v)


class SamplingFields(_Strict):
    """Sampling and drafting fields shared by the OpenAI endpoints."""

    temperature: float = Field(0.8, ge=0.0, le=100.0, description="0 = greedy")
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    top_k: int = Field(40, ge=0, description="llama.cpp extension; 0 = off")
    min_p: float = Field(0.05, ge=0.0, le=1.0, description="llama.cpp extension; 0 = off")
    seed: Optional[int] = Field(None, ge=0, lt=2**64)
    stop: Union[str, List[str], None] = Field(None)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n_draft_max: Optional[int] = Field(None, ge=0, le=256, description="drafts verified per cycle")
    use_drafter: bool = True
    # Standard OpenAI fields accepted only with the neutral value (validated below).
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    service_tier: Optional[str] = None
    metadata: Optional[Dict[str, Any]] = None
    store: Optional[bool] = None
    model: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        s = _stop_list(v)
        if len(s) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n = 1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported (only null or {})")
        return v

    @property
    def stop_list(self) -> List[str]:
        """``stop`` as a list (empty when unset)."""
        return _stop_list(self.stop)

    @property
    def include_usage(self) -> bool:
        """True when a streaming client asked for the final usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: Union[str, List[int], List[str]] = Field(..., description="text, token ids, or a list of one text")
    max_tokens: Optional[int] = Field(16, ge=1, description="OpenAI default 16; null = until EOG/context")
    echo: bool = False
    best_of: int = Field(1, ge=1)
    logprobs: Optional[int] = Field(None, ge=0)
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("the prompt is empty")
            if all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("only one prompt per request is supported")
                return v[0]
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only best_of = 1 is supported")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix (insertion) is not supported")
        return v


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message; ``content`` is text or a list of ``{"type": "text", "text": ...}`` parts."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, List[_TextPart], None] = None
    name: Optional[str] = None

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: List[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=0)

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @property
    def token_limit(self) -> Optional[int]:
        """``max_completion_tokens`` if given, else ``max_tokens`` (None = until EOG/context)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> List[Dict[str, str]]:
        """Messages as ``{"role", "content"}`` dicts for the chat template (developer -> system)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class LlamaCompletionRequest(_Strict):
    """Body of llama-server's ``POST /completion`` (its field names and defaults).

    ``n_predict`` -1 = until EOG or a full context; ``seed`` -1 = random. ``cache_prompt``,
    ``id_slot`` and ``n_probs`` = 0 are accepted and ignored (one slot, no prompt cache reuse).
    """

    prompt: Union[str, List[int]]
    n_predict: int = Field(-1, ge=-1)
    temperature: float = Field(0.8, ge=0.0, le=100.0)
    top_k: int = Field(40, ge=0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    min_p: float = Field(0.05, ge=0.0, le=1.0)
    seed: int = Field(-1, ge=-1, lt=2**64)
    stream: bool = False
    stop: List[str] = Field(default_factory=list, max_length=MAX_STOP)
    ignore_eos: bool = False
    n_draft_max: Optional[int] = Field(None, ge=0, le=256)
    cache_prompt: bool = True
    id_slot: int = -1
    n_probs: int = Field(0, ge=0, le=0)

    @model_validator(mode="after")
    def _nonzero(self):
        if self.n_predict == 0:
            raise ValueError("n_predict must be -1 or >= 1")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("the prompt is empty")
        return self
