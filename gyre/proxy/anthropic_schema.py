"""Anthropic Messages request bodies as pydantic models, checked before any tokenizing or engine work.

Strict types and the ranges the engines accept (top_p > 0). The blocks the proxy reads (text,
thinking, tool_use, tool_result) are checked field by field; other block types (image, document,
redacted_thinking, server tools, ...) only need a string `type`. Top-level fields the proxy has no use
for (thinking, context_management, output_config's effort, metadata, betas Claude Code sends) are accepted
and ignored, as are unknown keys inside objects. What would change the reply but cannot be honoured is refused
by name: `tool_choice` other than auto and none ("none" is honoured: the reply is text; so is
`disable_parallel_tool_use`: the reply ends with its first tool call), and a structured-output format (`output_format`,
`output_config.format`: no constrained decoding to a JSON schema).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gyre.proxy.schema_util import NonEmpty, ObjectSchema, refusal, str_or_list, tagged


class _Obj(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class OtherBlock(_Obj):
    type: str


class TextBlock(_Obj):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Obj):
    type: Literal["thinking"]
    thinking: str = ""


class ToolUseBlock(_Obj):
    type: Literal["tool_use"]
    id: str = ""
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


InnerBlock = tagged({"text": TextBlock}, "type", OtherBlock)
BLOCKS = "must be a string or a list of content blocks"


class ToolResultBlock(_Obj):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str_or_list(InnerBlock, BLOCKS) | None = None
    is_error: bool | None = None


Block = tagged(
    {"text": TextBlock, "thinking": ThinkingBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock},
    "type",
    OtherBlock,
)


class _Message(_Obj):
    content: str_or_list(Block, BLOCKS)


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    role: Literal["assistant"]


class SystemMessage(_Message):
    role: Literal["system"]


Message = tagged(
    {"user": UserMessage, "assistant": AssistantMessage, "system": SystemMessage},
    "role",
    refusal("role", "use user, assistant or system"),
)


class Tool(_Obj):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    input_schema: ObjectSchema | None = None


class ToolChoice(_Obj):
    type: Literal["auto", "none"]  # "any" / "tool": no constrained decoding to force a call, so refused
    disable_parallel_tool_use: bool | None = None  # true: honoured (the reply ends with its first tool call)


NO_FORMAT = "structured outputs are not served (no constrained decoding to a JSON schema): leave it out"


class OutputConfig(_Obj):
    format: Any = None

    @field_validator("format")
    @classmethod
    def _no_format(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(NO_FORMAT)
        return value


class MessagesBody(_Obj):
    """POST /v1/messages and /v1/messages/count_tokens."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)] = Field(default_factory=list, validate_default=True)
    system: str_or_list(InnerBlock, BLOCKS) | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop_sequences: list[NonEmpty] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    output_format: Any = None

    @field_validator("output_format")
    @classmethod
    def _no_output_format(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(NO_FORMAT)
        return value
