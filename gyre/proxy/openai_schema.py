"""OpenAI Chat Completions request bodies as pydantic models: what the proxy validates before any
tokenizing or engine work. Strict types (no "1" for 1, no 1.0 for an integer), ranges the engines accept
(top_p > 0: SGLang and the embedded engine refuse 0), and every parameter of the current SDK known
(tests compare with the installed `openai` package's CompletionCreateParams); parameters that mean
nothing here are accepted and ignored. What would change the reply but cannot be honoured is refused by name:
`tool_choice` other than "auto" and "none" (no constrained decoding to force a call), `top_logprobs` above 0
(the engines return the sampled token's logprob only), a `response_format` other than text (no constrained
decoding to a JSON schema), non-zero presence/frequency penalties and logit biases (the engines sample without them). Unknown top-level fields are refused, as OpenAI does.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gyre.proxy.schema_util import NonEmpty, ObjectSchema, refusal, str_or_list, tagged

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Part(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class TextPart(_Part):
    type: Literal["text"]
    text: str


class RefusalPart(_Part):
    type: Literal["refusal"]
    refusal: str


ONLY_TEXT = "only text parts are supported"
TextParts = tagged({"text": TextPart}, "type", refusal("type", ONLY_TEXT))
AssistantParts = tagged({"text": TextPart, "refusal": RefusalPart}, "type", refusal("type", ONLY_TEXT))
Content = str_or_list(TextParts, "must be a string or a list of text parts")
AssistantContent = str_or_list(AssistantParts, "must be a string or a list of text parts")


def json_object_arguments(value: str) -> str:
    """A tool call's `arguments`: empty, or the text of a JSON object (Chat Completions and Responses alike)."""
    if value.strip():
        try:
            parsed = json.loads(value)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"is not JSON: {e}") from e
        if not isinstance(parsed, dict):
            raise ValueError("must be a JSON object")
    return value


class FunctionCall(_Part):
    name: str
    arguments: str = ""

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        return json_object_arguments(value)


class ToolCall(_Part):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class _Message(_Part):
    name: str | None = None


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: Content


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: AssistantContent | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None


class ToolMessage(_Part):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ROLES = "use one of system, developer, user, assistant, tool"
Message = tagged(
    {"system": SystemMessage, "developer": SystemMessage, "user": UserMessage, "assistant": AssistantMessage,
     "tool": ToolMessage},
    "role",
    refusal("role", ROLES),
)  # fmt: skip


class FunctionDef(_Part):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"] = "function"
    function: FunctionDef


class StreamOptions(_Part):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class TextFormat(_Part):
    type: Literal["text"]


NO_TOP_LOGPROBS = "top logprobs are not served (the engines return the sampled token's logprob only): use 0"
NO_PENALTIES = "is not applied by the engines (training needs the logprobs of the distribution sampled): use 0"


class ChatCompletionBody(BaseModel):
    """POST /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] = Field(default_factory=list, validate_default=True)
    tools: list[Tool] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str_or_list(NonEmpty, "must be a string or a list of strings") | None = None
    seed: Int64 | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # above 0: refused (_no_top_logprobs)
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[str, Annotated[int, Field(ge=-100, le=100)]] | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    tool_choice: Literal["auto", "none"] | None = None  # "none": honoured (a text reply); others refused
    response_format: TextFormat | None = None  # json_object / json_schema: refused
    # accepted and ignored: they change nothing on a policy served from one checkpoint
    metadata: dict[str, str] | None = None
    store: bool | None = None
    reasoning_effort: Any = None
    verbosity: Any = None
    service_tier: Any = None
    modalities: Any = None
    prediction: Any = None
    audio: Any = None
    web_search_options: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    safety_identifier: str | None = None
    moderation: Any = None
    functions: Any = None  # deprecated, still sent by older clients
    function_call: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"only n=1 is supported, got n={value}")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        if value:
            raise ValueError(NO_TOP_LOGPROBS)
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None, info: Any) -> float | None:
        if value:
            raise ValueError(f"{info.field_name} {NO_PENALTIES}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        if value and any(value.values()):
            raise ValueError("logit_bias is not applied by the engines: send none (or only zero biases)")
        return value

    @field_validator("stop")
    @classmethod
    def _four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(value)}")
        return value
