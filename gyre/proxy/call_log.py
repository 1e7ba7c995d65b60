"""Every model call the proxy served, with its exact token ids: the raw material of trajectory trees.

Thread-safe: the proxy appends from its event loop while the trainer side reads and pops rollouts
from other threads.
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class SplicedSpan:
    """An earlier output spliced into a prompt: input_ids[start:start+length] == source's output_ids."""

    start: int
    length: int
    source_call_id: int


@dataclass
class CallRecord:
    rollout_id: str
    call_id: int
    api: str
    input_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    spliced: list[SplicedSpan]
    finish_reason: str  # "stop" | "length" | "tool_calls" (as answered to the client)
    weight_version: str
    engine_url: str
    prompt_tokens: int
    cached_tokens: int
    t_start: float
    t_end: float
    role: str = "main"
    tool_names: list[str] = field(default_factory=list)
    retokenized_turns: int = 0  # assistant turns in the prompt the proxy never produced
    content: str = ""  # the reply as answered: text part ...
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # ... and parsed calls {"name", "arguments"}
    # The sampling parameters sent to the engine (SGLang's names); output_logprobs describe the distribution
    # they define (rl.logprob_distribution). Logs written before they were recorded read as the defaults,
    # which is what their logprobs (log_softmax of the raw logits) describe.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    # rl.routing_replay: the experts the engine routed each position of input_ids + output_ids to, as the engine
    # ran them (the last output token, never fed back, has none): base64 of int16 [positions, MoE layers, top-k]
    # little-endian, and that shape; "" and [] without replay
    routed_experts: str = ""
    routed_experts_shape: list[int] = field(default_factory=list)
    # the engine request within [t_start, t_end]: sent after the prompt was rendered, answered before the reply
    # was parsed (0.0 in logs written before they were recorded)
    t_sent: float = 0.0
    t_answered: float = 0.0

    def routed_experts_rows(self) -> np.ndarray | None:
        """int16 [positions, MoE layers, top-k] of the call's routed experts; None when none were recorded."""
        if not self.routed_experts_shape:
            return None
        rows = np.frombuffer(base64.b64decode(self.routed_experts), dtype="<i2")
        return rows.reshape(self.routed_experts_shape)

    @property
    def tool_call_ids(self) -> list[str]:
        return [tool_call_id(self.call_id, n) for n in range(len(self.tool_calls))]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> CallRecord:
        return cls(**{**row, "spliced": [SplicedSpan(**s) for s in row["spliced"]]})


def encode_routed_experts(rows: np.ndarray) -> tuple[str, list[int]]:
    """(CallRecord.routed_experts, CallRecord.routed_experts_shape) of int [positions, MoE layers, top-k]."""
    return base64.b64encode(rows.astype("<i2").tobytes()).decode("ascii"), list(rows.shape)


def read_call_log(jsonl_path: str | Path) -> list[CallRecord]:
    """The records of a call log written by `CallLog(jsonl_path)` (one JSON object a line); a line
    that is not a record (truncated, another format) is a ValueError naming the file and line."""
    records = []
    for n, line in enumerate(Path(jsonl_path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(CallRecord.from_json(json.loads(line)))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{jsonl_path}:{n} is not a call record: {type(e).__name__}: {e}") from e
    return records


def tool_call_id(call_id: int, n: int) -> str:
    """The id handed to the client for the n-th tool call of a call; `parse_tool_call_id` inverts it."""
    return f"call_{call_id}_{n}"


def parse_tool_call_id(tool_call_id_: str) -> int | None:
    parts = tool_call_id_.split("_")
    if len(parts) != 3 or parts[0] != "call" or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[1])


def reply_key(content: str, tool_calls: list[dict[str, Any]]) -> str:
    """Identity of a reply independent of JSON key order and spacing."""
    calls = [[c["name"], c["arguments"]] for c in tool_calls]
    return json.dumps([content, calls], sort_keys=True, ensure_ascii=False)


class CallLog:
    """Call records by rollout; `jsonl_path` also appends each record as one JSON line."""

    def __init__(self, jsonl_path: str | Path | None = None) -> None:
        self._lock = threading.Lock()
        self._next_id = 0
        self._by_rollout: dict[str, list[CallRecord]] = {}
        self._by_id: dict[int, CallRecord] = {}
        self._by_reply: dict[tuple[str, str], CallRecord] = {}
        self._jsonl = Path(jsonl_path) if jsonl_path is not None else None
        if self._jsonl is not None:
            self._jsonl.parent.mkdir(parents=True, exist_ok=True)

    def next_call_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def add(self, record: CallRecord) -> None:
        with self._lock:
            if record.call_id in self._by_id:
                raise ValueError(f"call id {record.call_id} is already recorded; take ids from next_call_id()")
            self._by_rollout.setdefault(record.rollout_id, []).append(record)
            self._by_id[record.call_id] = record
            self._by_reply[(record.rollout_id, reply_key(record.content, record.tool_calls))] = record
            if self._jsonl is not None:
                with self._jsonl.open("a") as f:
                    f.write(json.dumps(record.to_json()) + "\n")

    def get(self, call_id: int) -> CallRecord | None:
        with self._lock:
            return self._by_id.get(call_id)

    def find_reply(self, rollout_id: str, content: str, tool_calls: list[dict[str, Any]]) -> CallRecord | None:
        """The latest call of this rollout that answered exactly this reply."""
        with self._lock:
            return self._by_reply.get((rollout_id, reply_key(content, tool_calls)))

    def for_rollout(self, rollout_id: str) -> list[CallRecord]:
        with self._lock:
            return list(self._by_rollout.get(rollout_id, []))

    def rollout_ids(self) -> list[str]:
        with self._lock:
            return list(self._by_rollout)

    def pop_rollout(self, rollout_id: str) -> list[CallRecord]:
        """Remove and return a rollout's records; later prompts can no longer splice them."""
        with self._lock:
            records = self._by_rollout.pop(rollout_id, [])
            for r in records:
                self._by_id.pop(r.call_id, None)
                key = (r.rollout_id, reply_key(r.content, r.tool_calls))
                if self._by_reply.get(key) is r:
                    del self._by_reply[key]
            return records

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)
