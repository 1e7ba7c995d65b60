"""Synthetic call logs shaped like a Claude Code rollout, for benchmarks and property tests.

A main thread re-sends its whole conversation each call (request k+1 = request k + reply + tool
result), with earlier replies spliced as exact output ids the way the proxy records them. Along the
way: sub-agents (own system prompt, own thread, the main thread waits), compactions (a summary call
on the thread minus its last turn, then a fresh thread that shares only the system prompt and tools
and carries the summary as re-tokenized text), retries (same prompt again; the first reply is
dropped and stays a dead branch) and side calls (title generation). Token ids are random; a small
vocabulary makes accidental shared prefixes likely, which is what property tests want.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyre.proxy.call_log import CallRecord, SplicedSpan


def make_record(
    call_id: int,
    input_ids: list[int],
    output_ids: list[int],
    role: str = "main",
    logprobs: list[float] | None = None,
    spliced: list[tuple[int, int, int]] | None = None,
    rollout_id: str = "r",
) -> CallRecord:
    """A call record with only the fields trees use set; spliced spans as (start, length, source)."""
    return CallRecord(
        rollout_id=rollout_id,
        call_id=call_id,
        api="synthetic",
        input_ids=list(input_ids),
        output_ids=list(output_ids),
        output_logprobs=[-0.1 * (i + 1) for i in range(len(output_ids))] if logprobs is None else list(logprobs),
        spliced=[SplicedSpan(*s) for s in spliced or []],
        finish_reason="stop",
        weight_version="v0",
        engine_url="synthetic",
        prompt_tokens=len(input_ids),
        cached_tokens=0,
        t_start=float(call_id),
        t_end=float(call_id) + 0.5,
        role=role,
    )


@dataclass(frozen=True)
class RolloutShape:
    n_calls: int = 300
    vocab: int = 150_000
    system_tokens: int = 20_000  # system prompt + tool schemas, shared by every main request
    subagent_system_tokens: int = 3_000
    output_tokens: tuple[int, int] = (50, 600)  # uniform range per reply
    tool_result_tokens: tuple[int, int] = (200, 6_000)
    context_limit: int = 160_000  # compact when a thread's prompt passes this
    p_subagent: float = 0.03  # per main call: spawn a sub-agent of 5-20 calls
    p_retry: float = 0.02
    p_side: float = 0.01


class _Thread:
    def __init__(self, role: str, prefix: list[int]) -> None:
        self.role = role
        self.prefix_len = len(prefix)
        self.ids = list(prefix)
        self.spans: list[SplicedSpan] = []
        self.last_turn_start = len(prefix)


class _Log:
    def __init__(self, rollout_id: str, shape: RolloutShape, rng: np.random.Generator) -> None:
        self.rollout_id, self.shape, self.rng = rollout_id, shape, rng
        self.records: list[CallRecord] = []

    def tokens(self, lo: int, hi: int | None = None) -> list[int]:
        n = lo if hi is None else int(self.rng.integers(lo, hi + 1))
        return self.rng.integers(0, self.shape.vocab, n).tolist()

    def call(self, input_ids: list[int], spans: list[SplicedSpan], role: str) -> CallRecord:
        out = self.tokens(*self.shape.output_tokens)
        logprobs = (-self.rng.exponential(1.0, len(out))).tolist()
        spliced = [(sp.start, sp.length, sp.source_call_id) for sp in spans]
        rec = make_record(len(self.records) + 1, input_ids, out, role, logprobs, spliced, self.rollout_id)
        self.records.append(rec)
        return rec

    def turn(self, th: _Thread) -> None:
        """One request on a thread: maybe a dropped retry first, then the reply and a tool result."""
        if self.rng.random() < self.shape.p_retry:
            self.call(list(th.ids), th.spans, th.role)  # dropped: a dead branch
        rec = self.call(list(th.ids), th.spans, th.role)
        th.last_turn_start = len(th.ids)
        th.spans.append(SplicedSpan(len(th.ids), len(rec.output_ids), rec.call_id))
        th.ids += rec.output_ids
        th.ids += self.tokens(*self.shape.tool_result_tokens)

    def compact(self, th: _Thread, system: list[int]) -> _Thread:
        keep = [s for s in th.spans if s.start + s.length <= th.last_turn_start]
        summary = self.call(th.ids[: th.last_turn_start] + self.tokens(40), keep, th.role + "_summary")
        fresh = _Thread(th.role, system)
        fresh.ids += self.tokens(30) + summary.output_ids + self.tokens(*self.shape.tool_result_tokens)
        return fresh


def claude_code_like_rollout(
    shape: RolloutShape = RolloutShape(), seed: int = 0, rollout_id: str = "r0"
) -> list[CallRecord]:
    """Call records of one synthetic rollout with exactly `shape.n_calls` calls (call ids 1..n)."""
    log = _Log(rollout_id, shape, np.random.default_rng(seed))
    system = log.tokens(shape.system_tokens)
    sub_system = log.tokens(shape.subagent_system_tokens)
    main = _Thread("main", system)
    main.ids += log.tokens(1) + log.tokens(*shape.tool_result_tokens)  # the task (never an empty prompt)
    while len(log.records) < shape.n_calls:
        if log.rng.random() < shape.p_side:
            log.call(log.tokens(200) + main.ids[-50:], [], "side")
            continue
        log.turn(main)
        if len(main.ids) > shape.context_limit:
            main = log.compact(main, system)
        if log.rng.random() < shape.p_subagent:
            sub = _Thread("subagent", sub_system)
            sub.ids += log.tokens(1) + log.tokens(*shape.tool_result_tokens)
            for _ in range(int(log.rng.integers(5, 21))):
                if len(log.records) >= shape.n_calls:
                    break
                log.turn(sub)
                if len(sub.ids) > shape.context_limit:
                    sub = log.compact(sub, sub_system)
            main.ids += log.tokens(*shape.tool_result_tokens)
    return log.records[: shape.n_calls]
