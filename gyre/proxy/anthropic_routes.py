"""HTTP handlers for the Anthropic Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`.

Every failure is answered in Anthropic's error shape (Claude Code reads the status and the message:
it retries 529/5xx, compacts on "prompt is too long", gives up on other 400s). The reply is generated
in full before the first byte is sent, so errors are always plain HTTP errors, never a broken stream.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gyre.model.tokenizer import Tokenizer
from gyre.proxy.anthropic_api import (
    STOP_REASONS,
    MessagesRequest,
    message_body,
    parse_messages_request,
    reply_blocks,
    sse_events,
    usage,
)
from gyre.proxy.call_log import CallRecord
from gyre.proxy.calls import CallRunner
from gyre.proxy.errors import ProxyError, invalid_request
from gyre.proxy.roles import anthropic_call_role

log = logging.getLogger(__name__)
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error",
}  # fmt: skip
OVERLOADED = 529  # Anthropic's status for "try again later"; harnesses retry it with backoff


class AnthropicRoutes:
    def __init__(
        self, runner: CallRunner, tokenizer: Tokenizer, rollout_of: Callable[[web.Request], str], model_name: str
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.rollout_of = rollout_of
        self.model_name = model_name

    def add_to(self, app: web.Application, prefix: str = "") -> None:
        app.router.add_post(f"{prefix}/v1/messages", self.messages)
        app.router.add_post(f"{prefix}/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get(prefix or "/", self.base_url)  # Claude Code sends HEAD <base URL> at start-up

    @staticmethod
    async def base_url(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _request(self, request: web.Request) -> MessagesRequest:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid_request(f"request body is not valid JSON: {e}") from e
        return parse_messages_request(body, self.model_name)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        try:
            req = await self._request(request)
            role = anthropic_call_role(request.headers, req.system_text, req.user_text, bool(req.tools))
            record = await self.runner.run(
                self.rollout_of(request), "anthropic", req.messages, req.tools, req.params, req.tool_names, role
            )
        except Exception as e:  # noqa: BLE001 - every failure gets an Anthropic-shaped answer
            return error_response(e, request)
        msg_id = f"msg_gyre{record.call_id}_{uuid.uuid4().hex[:12]}"
        blocks = reply_blocks(record.content, record.tool_calls, record.tool_call_ids, f"gyre-call-{record.call_id}")
        stop_reason, stop_sequence = self._stop(record, req)
        use = usage(record.prompt_tokens, len(record.output_ids))
        if not req.stream:
            return web.json_response(message_body(msg_id, req.model, blocks, stop_reason, stop_sequence, use))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for name, data in sse_events(msg_id, req.model, blocks, stop_reason, stop_sequence, use):
            await resp.write(f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode())
        await resp.write_eof()
        return resp

    def _stop(self, record: CallRecord, req: MessagesRequest) -> tuple[str, str | None]:
        if record.finish_reason == "stop" and req.params.stop:
            text = self.tokenizer.decode(record.output_ids)
            hits = [(text.find(s), s) for s in req.params.stop if s in text]
            if hits:
                return "stop_sequence", min(hits)[1]
        return STOP_REASONS.get(record.finish_reason, "end_turn"), None

    async def count_tokens(self, request: web.Request) -> web.Response:
        """The prompt's length exactly as a /v1/messages call would report it in usage.input_tokens."""
        try:
            req = await self._request(request)
            prompt = await self.runner.render(self.rollout_of(request), req.messages, req.tools)
        except Exception as e:  # noqa: BLE001
            return error_response(e, request)
        return web.json_response({"input_tokens": len(prompt.input_ids)})


def error_response(err: Exception, request: web.Request) -> web.Response:
    if not isinstance(err, ProxyError):
        log.exception("unhandled error in %s %s", request.method, request.path, exc_info=err)
        err = ProxyError(500, f"internal proxy error: {type(err).__name__}: {err}", "server_error")
    status, body = error_status_and_body(err)
    return web.json_response(body, status=status)


def error_status_and_body(err: ProxyError) -> tuple[int, dict[str, Any]]:
    """A proxy error in Anthropic's shape. Context overflow reads as Anthropic words it, which is
    what makes Claude Code compact; an engine that is down or busy reads as 529 overloaded."""
    status, message = err.status, err.message
    if err.code == "context_length_exceeded" and err.details:
        message = f"prompt is too long: {err.details['prompt_tokens']} tokens > {err.details['limit']} maximum"
    if status == 503:
        status = OVERLOADED
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}
