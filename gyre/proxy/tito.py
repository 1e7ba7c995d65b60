"""Token-in/token-out: render a conversation to input ids with earlier replies as their exact output ids.

A harness re-sends the whole conversation each turn and re-serializes what it got back (tool-call
JSON with other key order and spacing, ids, text). Re-tokenizing that text would condition the
model on tokens it never produced, so each assistant turn is looked up in the rollout's call log,
first by the tool-call ids the proxy handed out, then by the exact reply, and spliced in as the
generated ids. Only replies the proxy never produced are tokenized from text, and counted.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from gyre.model.chat_template import AssistantTurn, TemplateError, assistant_body, content_text, render_segments
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog, CallRecord, SplicedSpan, parse_tool_call_id


@dataclass
class RenderedPrompt:
    input_ids: list[int]
    spliced: list[SplicedSpan] = field(default_factory=list)
    retokenized_turns: int = 0


def message_tool_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message's tool calls as {"name", "arguments" (parsed)}; raises TemplateError if malformed."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise TemplateError(f"tool call arguments are not JSON: {e}") from e
        calls.append({"name": fn.get("name", ""), "arguments": args})
    return calls


class TitoRenderer:
    """Renders prompts for one proxy; caches the ids of text segments, which repeat every turn."""

    def __init__(self, tokenizer: Tokenizer, call_log: CallLog, cache_entries: int = 4096) -> None:
        self.tokenizer = tokenizer
        self.call_log = call_log
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cache_entries = cache_entries
        self._cache_lock = threading.Lock()

    def encode_segment(self, text: str) -> list[int]:
        with self._cache_lock:
            ids = self._cache.get(text)
            if ids is not None:
                self._cache.move_to_end(text)
                return ids
        ids = self.tokenizer.encode(text)
        with self._cache_lock:
            self._cache[text] = ids
            if len(self._cache) > self._cache_entries:
                self._cache.popitem(last=False)
        return ids

    def find_source(self, rollout_id: str, message: dict[str, Any]) -> CallRecord | None:
        """The call that produced this assistant message, or None if the proxy never produced it.

        A tool-call id match splices even if the text part came back altered (e.g. stripped).
        """
        calls = message_tool_calls(message)
        for call in message.get("tool_calls") or []:
            call_id = parse_tool_call_id(str(call.get("id", "")))
            record = self.call_log.get(call_id) if call_id is not None else None
            # The id alone could be stale or forged: the calls themselves must be the ones answered.
            if record is not None and record.rollout_id == rollout_id and record.tool_calls == calls:
                return record
        return self.call_log.find_reply(rollout_id, content_text(message.get("content")), calls)

    def render(
        self, rollout_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> RenderedPrompt:
        out = RenderedPrompt(input_ids=[])
        for seg in render_segments(messages, tools):
            if not isinstance(seg, AssistantTurn):
                out.input_ids.extend(self.encode_segment(seg))
                continue
            record = self.find_source(rollout_id, seg.message)
            if record is None:
                out.input_ids.extend(self.tokenizer.encode(assistant_body(seg.message)))
                out.retokenized_turns += 1
                continue
            out.spliced.append(SplicedSpan(len(out.input_ids), len(record.output_ids), record.call_id))
            out.input_ids.extend(record.output_ids)
            if not record.output_ids or record.output_ids[-1] != self.tokenizer.eos_id:
                # Cut by max_tokens or a stop string: close the turn as the template does.
                out.input_ids.append(self.tokenizer.eos_id)
        return out
