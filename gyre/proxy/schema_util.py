"""Building blocks of the request schemas (gyre.proxy.openai_schema, anthropic_schema).

Unions are chosen by a callable discriminator and their members tagged `~...`, so that an error names
what was found (not every member's complaint) and its location reads as a plain path once the tags
are dropped (gyre.proxy.errors.validation_error).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, ValidationError, model_validator

M = TypeVar("M", bound=BaseModel)
SLICE = 256  # list items validated per call of pydantic (~25 ms of the largest items the schemas take)

NonEmpty = Annotated[str, Field(min_length=1)]


class ObjectSchema(BaseModel):
    """A tool's parameters: a JSON Schema object, checked where the chat template reads it (the names of
    `properties` and the `required` list); the rest is passed on as sent."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str | list[str] | None = None
    properties: dict[str, dict[str, Any] | bool] | None = None
    required: list[str] | None = None


def tagged(members: dict[str, Any], key: str, other: Any = None) -> Any:
    """A union chosen by the string at `key` of an object; values no member takes go to `other` (a
    catch-all, or a `refusal` model: pydantic's own message would not name the value)."""

    def pick(value: Any) -> str | None:
        if not isinstance(value, dict):
            return None
        tag = value.get(key)
        return f"~{tag}" if isinstance(tag, str) and tag in members else "~other"

    choices = [Annotated[model, Tag(f"~{tag}")] for tag, model in members.items()]
    if other is not None:
        choices.append(Annotated[other, Tag("~other")])
    union: Any = choices[0]
    for choice in choices[1:]:
        union = union | choice
    return Annotated[
        union, Discriminator(pick, custom_error_type="object_type", custom_error_message="must be an object")
    ]


def refusal(key: str, expected: str) -> type[BaseModel]:
    """The `other` model of `tagged` that refuses: an error naming the value found at `key`."""

    class Refused(BaseModel):
        @model_validator(mode="before")
        @classmethod
        def _refuse(cls, value: Any) -> Any:
            raise ValueError(f"{key} is {repr(value.get(key))[:80]}; {expected}")

    return Refused


def str_or_list(item: Any, message: str) -> Any:
    """A string or a list of `item`; anything else gets `message`."""

    def pick(value: Any) -> str | None:
        return "~string" if isinstance(value, str) else "~list" if isinstance(value, list) else None

    members = Annotated[str, Tag("~string")] | Annotated[list[item], Tag("~list")]
    return Annotated[members, Discriminator(pick, custom_error_type="str_or_list", custom_error_message=message)]


def validate_in_slices(model: type[M], body: Any, lists: Mapping[str, TypeAdapter]) -> tuple[M | None, list[Any]]:
    """`model.model_validate(body)`, the fields of `lists` longer than SLICE validated SLICE items at a time:
    pydantic holds the GIL through a whole call (131K messages: seconds), so slices let the event loop run
    in between. (The model of the body with those lists cut to their first item or None, every error as
    pydantic's `errors()` lists them, located in the whole body.)"""
    if not isinstance(body, dict):
        long: dict[str, list[Any]] = {}
    else:
        long = {k: v for k in lists if isinstance(v := body.get(k), list) and len(v) > SLICE}
    errors: list[Any] = []
    validated = None
    try:
        validated = model.model_validate({**body, **{k: v[:1] for k, v in long.items()}} if long else body)
    except ValidationError as e:
        errors.extend(e.errors(include_url=False, include_input=False))
    for key, items in long.items():
        for start in range(1, len(items), SLICE):
            try:
                lists[key].validate_python(items[start : start + SLICE])
            except ValidationError as e:
                for err in e.errors(include_url=False, include_input=False):
                    errors.append({**err, "loc": (key, start + err["loc"][0], *err["loc"][1:])})
    return validated, errors
