"""HTTP handler for the OpenAI Responses API: `POST /v1/responses` (what Codex CLI speaks).

Failures are answered in OpenAI's error shape by the proxy's error middleware (gyre.proxy.errors). The
reply is generated in full before the first byte is sent, so errors are always plain HTTP errors, never
a broken stream.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from gyre.proxy.calls import CallRunner
from gyre.proxy.responses_api import output_items, parse_responses_request, response_body, sse_events, usage
from gyre.proxy.roles import chat_call_role


class ResponsesRoutes:
    def __init__(
        self,
        runner: CallRunner,
        rollout_of: Callable[[web.Request], str],
        model_name: str,
        read_body: Callable[[web.Request], Awaitable[bytes]],
    ) -> None:
        self.runner = runner
        self.rollout_of = rollout_of
        self.model_name = model_name
        self.read_body = read_body

    def add_to(self, app: web.Application, prefix: str = "") -> None:
        app.router.add_post(f"{prefix}/v1/responses", self.responses)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        rollout_id = self.rollout_of(request)
        body = await self.read_body(request)
        req = await self.runner.parse(rollout_id, parse_responses_request, body, self.model_name)
        role = chat_call_role(request.headers, req.messages, bool(req.tools))  # Codex: x-codex-turn-metadata
        record = await self.runner.run(
            rollout_id, "responses", req.messages, req.tools, req.params, req.tool_names, role
        )
        resp_id = f"resp_gyre{record.call_id}_{uuid.uuid4().hex[:12]}"
        items = output_items(record.call_id, record.content, record.tool_calls, record.tool_call_ids)
        use = usage(record.prompt_tokens, len(record.output_ids), record.cached_tokens)
        done = response_body(resp_id, record.t_start, req, items, record.finish_reason, use)
        if not req.stream:
            return web.json_response(done)
        start = response_body(resp_id, record.t_start, req, [], record.finish_reason, None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for event in sse_events(start, done):
            await resp.write(f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode())
        await resp.write_eof()
        return resp
