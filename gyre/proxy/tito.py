"""Token-in/token-out: render a conversation to input ids with earlier replies as their exact output ids.

A harness re-sends the whole conversation each turn and re-serializes what it got back (tool-call
JSON with other key order and spacing, ids, text). Re-tokenizing that text would condition the
model on tokens it never produced, so each assistant turn is looked up in the rollout's call log,
first by the tool-call ids the proxy handed out, then by the exact reply, and spliced in as the
generated ids. Only replies the proxy never produced are tokenized from text, and counted.

Rendering is planned before anything is tokenized (`plan`): the plan's text bounds its token count from
below (`PromptPlan.min_tokens`), so a prompt that cannot fit the context is refused without tokenizing
megabytes. Tokenizing releases the GIL (`Tokenizer.encode_unlocked`): it runs in a worker thread while the
proxy's event loop goes on serving.
"""

from __future__ import annotations

import json
import sys
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


class TokenCache:
    """Ids of text segments, least recently used dropped first, bounded by an estimate of the bytes held
    (text and id list as Python objects): segments repeat every turn, but one 5 MB message would hold
    ~200 MB of ids. Segments over `max_bytes / 16` are not kept. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, tuple[list[int], int]] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def cost(text: str, ids: list[int]) -> int:
        return sys.getsizeof(text) + sys.getsizeof(ids) + 32 * len(ids)  # an int object each (small ones shared)

    def get(self, text: str) -> list[int] | None:
        with self._lock:
            entry = self._entries.get(text)
            if entry is None:
                return None
            self._entries.move_to_end(text)
            return entry[0]

    def put(self, text: str, ids: list[int]) -> None:
        cost = self.cost(text, ids)
        if cost > self.max_bytes // 16:
            return
        with self._lock:
            old = self._entries.pop(text, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[text] = (ids, cost)
            self.bytes += cost
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


@dataclass
class PlannedTurn:
    """An assistant turn: spliced from `record` when the proxy produced it, else tokenized from `text`."""

    record: CallRecord | None
    text: str = ""


@dataclass
class PromptPlan:
    parts: list[str | PlannedTurn]

    def min_tokens(self, max_token_chars: int) -> int:
        """A lower bound of the prompt's tokens, from lengths alone: each token covers at most
        `max_token_chars` characters of text; a spliced turn is its ids (and the end of turn)."""
        chars, tokens = 0, 0
        for part in self.parts:
            if isinstance(part, str):
                chars += len(part)
            elif part.record is None:
                chars += len(part.text)
            else:
                tokens += len(part.record.output_ids)
        return tokens + chars // max_token_chars


class TitoRenderer:
    """Renders prompts for one proxy; caches the ids of text segments, which repeat every turn."""

    def __init__(self, tokenizer: Tokenizer, call_log: CallLog, cache_bytes: int = 256 << 20) -> None:
        self.tokenizer = tokenizer
        self.call_log = call_log
        self.cache = TokenCache(cache_bytes)

    def encode_segment(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            ids = self.tokenizer.encode_unlocked(text)
            self.cache.put(text, ids)
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

    def plan(self, rollout_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> PromptPlan:
        """The prompt's text segments and assistant turns, each turn's source looked up; nothing tokenized."""
        parts: list[str | PlannedTurn] = []
        for seg in render_segments(messages, tools):
            if not isinstance(seg, AssistantTurn):
                parts.append(seg)
                continue
            record = self.find_source(rollout_id, seg.message)
            parts.append(PlannedTurn(record, "" if record is not None else assistant_body(seg.message)))
        return PromptPlan(parts)

    def encode(self, plan: PromptPlan) -> RenderedPrompt:
        out = RenderedPrompt(input_ids=[])
        for part in plan.parts:
            if isinstance(part, str):
                out.input_ids.extend(self.encode_segment(part))
                continue
            record = part.record
            if record is None:
                out.input_ids.extend(self.tokenizer.encode_unlocked(part.text))
                out.retokenized_turns += 1
                continue
            out.spliced.append(SplicedSpan(len(out.input_ids), len(record.output_ids), record.call_id))
            out.input_ids.extend(record.output_ids)
            if not record.output_ids or record.output_ids[-1] != self.tokenizer.eos_id:
                # Cut by max_tokens or a stop string: close the turn as the template does.
                out.input_ids.append(self.tokenizer.eos_id)
        return out

    def render(
        self, rollout_id: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> RenderedPrompt:
        return self.encode(self.plan(rollout_id, messages, tools))
