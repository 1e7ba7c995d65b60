"""Errors in OpenAI's own shape: {"error": {"message", "type", "param", "code"}}.

Harnesses decide what to do from the status and the code (retry on 5xx, compact on
`context_length_exceeded`, give up on other 4xx), so every failure path ends here.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger(__name__)


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

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> ProxyError:
    return ProxyError(400, message, "invalid_request_error", param, code)


def context_length_exceeded(limit: int, prompt_tokens: int) -> ProxyError:
    message = (
        f"This model's maximum context length is {limit} tokens. "
        f"However, your messages resulted in {prompt_tokens} tokens."
    )
    details = {"limit": limit, "prompt_tokens": prompt_tokens}
    return ProxyError(400, message, "invalid_request_error", "messages", "context_length_exceeded", details)


def engine_unavailable(message: str) -> ProxyError:
    return ProxyError(503, message, "server_error", None, "engine_unavailable")


def engine_failed(message: str) -> ProxyError:
    return ProxyError(502, message, "server_error", None, "engine_error")


def engine_timeout(message: str) -> ProxyError:
    return ProxyError(504, message, "server_error", None, "engine_timeout")


def error_response(err: ProxyError) -> web.Response:
    return web.json_response(err.body(), status=err.status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into an OpenAI-shaped error, so no client ever sees an HTML 500."""
    try:
        return await handler(request)
    except ProxyError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        message = f"{request.method} {request.path}: {e.reason}"
        return error_response(ProxyError(e.status, message, kind))
    except json.JSONDecodeError as e:
        return error_response(invalid_request(f"request body is not valid JSON: {e}"))
    except Exception as e:  # noqa: BLE001 - the proxy must answer, whatever went wrong
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ProxyError(500, f"internal proxy error: {type(e).__name__}: {e}", "server_error"))
