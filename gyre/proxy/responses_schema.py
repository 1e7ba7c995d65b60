"""OpenAI Responses request bodies (`POST /v1/responses`) as pydantic models, checked before any work.

The input items the proxy reads (messages, `function_call`, `function_call_output`, `reasoning`) are
checked field by field; tools must be of type `function` (the policy has no built-in tools to run for
the others). Fields that change nothing for a policy served from one checkpoint (store, include,
metadata, prompt_cache_key, reasoning, text verbosity, service_tier, ...) are accepted and ignored;
fields the proxy cannot honour are refused by name: `previous_response_id` and `conversation` (the
proxy keeps no conversation state: send the whole input, as Codex does with `store: false`),
`background`, `top_logprobs`, a `text.format` other than plain text, `tool_choice` other than
"auto" and "none" ("none" is honoured: the reply is text), `include` of anything but
`reasoning.encrypted_content` (the reasoning text comes back in full instead), `max_tool_calls` (not counted),
`truncation: "auto"` (the proxy never drops input: an overlong input is a context error). Unknown top-level
fields are refused, as OpenAI does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from gyre.proxy.openai_schema import json_object_arguments
from gyre.proxy.schema_util import ObjectSchema, refusal, str_or_list, tagged


class _Obj(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class InputText(_Obj):
    type: Literal["input_text", "output_text"]
    text: str


class Refusal(_Obj):
    type: Literal["refusal"]
    refusal: str


ONLY_TEXT = "only input_text / output_text parts are supported"
Part = tagged(
    {"input_text": InputText, "output_text": InputText, "refusal": Refusal}, "type", refusal("type", ONLY_TEXT)
)
Content = str_or_list(Part, "must be a string or a list of input_text parts")


class MessageItem(_Obj):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


class FunctionCallItem(_Obj):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        return json_object_arguments(value)


class FunctionCallOutputItem(_Obj):
    type: Literal["function_call_output"]
    call_id: str
    output: Content


class SummaryText(_Obj):
    type: str
    text: str


class ReasoningItem(_Obj):
    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[SummaryText] | None = None
    encrypted_content: str | None = None


def _item_kind(value: Any) -> str | None:
    """A message may leave out `type` (the SDK's EasyInputMessage)."""
    if not isinstance(value, dict):
        return None
    kind = value.get("type", "message")
    return f"~{kind}" if kind in ITEM_KINDS else "~other"


ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
ITEMS = "use one of message, function_call, function_call_output, reasoning"
Item = Annotated[
    Annotated[MessageItem, Tag("~message")]
    | Annotated[FunctionCallItem, Tag("~function_call")]
    | Annotated[FunctionCallOutputItem, Tag("~function_call_output")]
    | Annotated[ReasoningItem, Tag("~reasoning")]
    | Annotated[refusal("type", ITEMS), Tag("~other")],
    Discriminator(_item_kind, custom_error_type="object_type", custom_error_message="must be an object"),
]
Input = str_or_list(Item, "must be a string or a list of input items")


class FunctionTool(_Obj):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: ObjectSchema | None = None
    strict: bool | None = None


TOOL_KINDS = "only tools of type function are served (the policy runs no built-in tools)"
Tool = tagged({"function": FunctionTool}, "type", refusal("type", TOOL_KINDS))


class TextFormat(_Obj):
    type: Literal["text"]


class TextConfig(_Obj):
    format: TextFormat | None = None  # json_schema / json_object: not honoured, so refused
    verbosity: str | None = None


class ResponsesBody(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    input: Input
    instructions: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | None = None  # "required"/a named tool: not enforced, so refused
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    include: list[str] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tool_calls: Any = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    text: TextConfig | None = None
    # accepted and ignored: they change nothing on a policy served from one checkpoint
    reasoning: Any = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None
    service_tier: Any = None
    truncation: Any = None
    user: str | None = None
    safety_identifier: str | None = None
    client_metadata: Any = None
    prompt_cache_options: Any = None
    context_management: Any = None
    moderation: Any = None
    access_programs: Any = None
    background_options: Any = None  # meaningless without background, which is refused
    # refused: the proxy cannot honour them
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    top_logprobs: Any = None
    prompt: Any = None
    image: Any = None

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _stateless(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("the proxy keeps no conversation state: send the whole conversation in `input`")
        return value

    @field_validator("background", "prompt", "image")
    @classmethod
    def _unsupported(cls, value: Any) -> Any:
        if value not in (None, False):
            raise ValueError("is not supported by this server")
        return value

    @field_validator("include")
    @classmethod
    def _only_encrypted_reasoning(cls, value: list[str] | None) -> list[str] | None:
        other = [v for v in value or [] if v != "reasoning.encrypted_content"]
        if other:
            raise ValueError(f"{other} cannot be included: only reasoning.encrypted_content (the reasoning text "
                             f"comes back in full) is served")  # fmt: skip
        return value

    @field_validator("max_tool_calls")
    @classmethod
    def _no_tool_call_cap(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("is not enforced by this server (a reply may hold several tool calls): leave it out")
        return value

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: Any) -> Any:
        if value not in (None, "disabled"):
            raise ValueError('only "disabled": the proxy never drops input (an overlong input is a context error)')
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: Any) -> Any:
        if value not in (None, 0):
            raise ValueError("top logprobs are not served (the engines return the sampled token's logprob only)")
        return value
