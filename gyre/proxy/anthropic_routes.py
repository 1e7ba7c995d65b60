"""HTTP handlers for the Anthropic Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`.

Every failure is answered in Anthropic's error shape by the proxy's error middleware (gyre.proxy.errors;
Claude Code reads the status and the message: it retries 529/5xx, compacts on "prompt is too long",
gives up on other 400s). The reply is generated
in full before the first byte is sent, so errors are always plain HTTP errors, never a broken stream.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable

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
from gyre.proxy.errors import ProxyError
from gyre.proxy.roles import call_role

log = logging.getLogger(__name__)


class AnthropicRoutes:
    def __init__(
        self,
        runner: CallRunner,
        tokenizer: Tokenizer,
        rollout_of: Callable[[web.Request], str],
        model_name: str,
        read_body: Callable[[web.Request], Awaitable[bytes]],
    ) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.rollout_of = rollout_of
        self.model_name = model_name
        self.read_body = read_body

    def add_to(self, app: web.Application, prefix: str = "") -> None:
        app.router.add_post(f"{prefix}/v1/messages", self.messages)
        app.router.add_post(f"{prefix}/v1/messages/count_tokens", self.count_tokens)
        app.router.add_get(prefix or "/", self.base_url)  # Claude Code sends HEAD <base URL> at start-up

    @staticmethod
    async def base_url(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _request(self, request: web.Request, rollout_id: str) -> MessagesRequest:
        body = await self.read_body(request)
        return await self.runner.parse(rollout_id, parse_messages_request, body, self.model_name)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        rollout_id = self.rollout_of(request)
        req = await self._request(request, rollout_id)
        role = call_role(request.headers, req.system_text, req.user_text, bool(req.tools))
        record = await self.runner.run(
            rollout_id, "anthropic", req.messages, req.tools, req.params, req.tool_names, role
        )
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
        """The prompt's length exactly as a /v1/messages call would report it in usage.input_tokens. A prompt
        that cannot fit the context by its lengths alone is answered "prompt is too long" instead of being
        tokenized (without the header that attributes a rollout's end to its context: nothing was generated)."""
        rollout_id = self.rollout_of(request)
        try:
            req = await self._request(request, rollout_id)
            prompt = await self.runner.render(rollout_id, req.messages, req.tools)
        except ProxyError as e:
            e.limit_header = False
            raise
        return web.json_response({"input_tokens": len(prompt.input_ids)})
