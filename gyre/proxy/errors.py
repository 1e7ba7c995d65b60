"""Errors in each API's own shape.

OpenAI: {"error": {"message", "type", "param", "code"}}. Anthropic: {"type": "error", "error": {"type",
"message"}}. Harnesses decide what to do from the status and the code (retry on 5xx, compact on
`context_length_exceeded` / "prompt is too long", give up on other 4xx), so every failure path ends here:
request validation (pydantic), body limits and timeouts, engine failures, unknown paths and methods.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import ValidationError

log = logging.getLogger(__name__)
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    405: "invalid_request_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
    504: "timeout_error", 529: "overloaded_error",
}  # fmt: skip
OVERLOADED = 529  # Anthropic's status for "try again later"; harnesses retry it with backoff
# on every context-overflow answer, "<prompt tokens> > <limit>": the rollout's endpoint (gyre/harness/endpoint.py)
# records it on the proxy's side, where the agent cannot forge it, to attribute the rollout's end to the limit
CONTEXT_LIMIT_HEADER = "X-Gyre-Context-Limit"


class ProxyError(Exception):
    """An error answered to the client; `status` is the HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        details: dict[str, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.details = details  # numbers behind the message, for other API dialects to word it their way
        self.close_connection = False  # the request left the connection unusable: answer, then close it
        self.retry_after_s: int | None = None  # sent as Retry-After
        self.limit_header = True  # a context overflow carries CONTEXT_LIMIT_HEADER (not for count_tokens)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(limit: int, prompt_tokens: int, at_least: bool = False) -> ProxyError:
    """`at_least`: the prompt was not tokenized, `prompt_tokens` is a lower bound from its length."""
    count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
    message = (
        f"This model's maximum context length is {limit} tokens. However, your messages resulted in {count} tokens."
    )
    details = {"limit": limit, "prompt_tokens": prompt_tokens}
    return ProxyError(400, message, "invalid_request_error", "messages", "context_length_exceeded", details)


def engine_unavailable(message: str) -> ProxyError:
    return ProxyError(503, message, "server_error", None, "engine_unavailable")


def engine_failed(message: str) -> ProxyError:
    return ProxyError(502, message, "server_error", None, "engine_error")


def engine_timeout(message: str) -> ProxyError:
    return ProxyError(504, message, "server_error", None, "engine_timeout")


# ---------------------------------------------------------------- validation errors


def _where(loc: tuple[int | str, ...]) -> str:
    """`messages[0].content` from pydantic's location; union tags (named `~...` by the schemas) dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("~"):
            out += f".{part}" if out else part
    return out or "body"


def _describe(err: dict[str, Any]) -> str:
    where, kind, ctx = _where(err["loc"]), err["type"], err.get("ctx") or {}
    if kind == "too_short" and ctx.get("min_length") == 1:
        return f"{where} must be a non-empty list"
    if kind == "missing":
        return f"{where} is required"
    if kind == "union_tag_invalid":
        tag, field = str(ctx.get("tag", "")).lstrip("~"), str(ctx.get("discriminator", "type")).strip("'~")
        return f"{where}.{field} is {tag!r}; expected one of {ctx.get('expected_tags', '').replace('~', '')}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}"


def validation_error(e: ValidationError | list[Any]) -> ProxyError:
    """The first problem of a request that does not fit its API's schema, as a 400 naming the field;
    `e` is pydantic's error or the list of its `errors()`."""
    errors = e.errors(include_url=False, include_input=False) if isinstance(e, ValidationError) else e
    unknown = [str(err["loc"][0]) for err in errors if err["type"] == "extra_forbidden" and len(err["loc"]) == 1]
    if unknown:
        return invalid_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    first = errors[0]
    param = next((str(p) for p in first["loc"] if isinstance(p, str) and not p.startswith("~")), None)
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return invalid_request(_describe(first) + more, param)


# ---------------------------------------------------------------- dialects


def anthropic_status_and_body(err: ProxyError) -> tuple[int, dict[str, Any]]:
    """A proxy error in Anthropic's shape. Context overflow reads as Anthropic words it, which is
    what makes Claude Code compact; an engine that is down or busy reads as 529 overloaded."""
    status, message = err.status, err.message
    if err.code == "context_length_exceeded" and err.details:
        message = f"prompt is too long: {err.details['prompt_tokens']} tokens > {err.details['limit']} maximum"
    if status == 503:
        status = OVERLOADED
    kind = ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def is_anthropic(request: web.BaseRequest) -> bool:
    """Anthropic's SDKs and Claude Code send `anthropic-version`; its paths are /v1/messages and /v1/complete."""
    path = request.path.split("/v1/", 1)[-1] if "/v1/" in request.path else ""
    return "anthropic-version" in request.headers or path.startswith(("messages", "complete"))


def error_response(err: ProxyError, request: web.BaseRequest | None = None) -> web.Response:
    if request is not None and is_anthropic(request):
        status, body = anthropic_status_and_body(err)
        resp = web.json_response(body, status=status)
    else:
        resp = web.json_response(err.body(), status=err.status)
    if err.retry_after_s is not None:
        resp.headers["Retry-After"] = str(err.retry_after_s)
    if err.code == "context_length_exceeded" and err.details and err.limit_header:
        resp.headers[CONTEXT_LIMIT_HEADER] = f"{err.details['prompt_tokens']} > {err.details['limit']}"
    if err.close_connection:
        resp.force_close()
    return resp


def both_shapes_body(status: int, message: str) -> dict[str, Any]:
    """For errors raised before the request is known (a malformed request line, an encoding aiohttp cannot
    decode): Anthropic's shape whose `error` also carries OpenAI's fields, so both SDKs read it."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message, "param": None, "code": None}}


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _http_error(e: web.HTTPException, request: web.Request) -> ProxyError:
    kind = "not_found_error" if e.status == 404 else "invalid_request_error"
    reason = e.text if e.status == 413 and e.text else e.reason
    return ProxyError(e.status, f"{request.method} {request.path}: {reason}", kind)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into an error in the caller's API shape, so no client ever sees an HTML 500."""
    try:
        return await handler(request)
    except ProxyError as e:
        return error_response(e, request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(_http_error(e, request), request)
    except ConnectionError:
        raise  # the client went away: nobody to answer (aiohttp drops the connection quietly)
    except Exception as e:  # noqa: BLE001 - the proxy must answer, whatever went wrong
        log.exception("unhandled error in %s %s", request.method, request.path)
        err = ProxyError(500, f"internal proxy error: {type(e).__name__}: {e}", "server_error")
        return error_response(err, request)
