"""Who a failed rollout's failure belongs to: the infrastructure (excluded) or the agent (scored 0).

Only what the agent cannot forge decides: whether the sandbox came up (the launcher's start signal),
the harness's exit status, and the failures its proxy endpoint saw on the proxy's side. The result
file is the harness's own (agent-writable) report: it may say "api_error", but an API error the
endpoint never saw is the agent's doing, not an exclusion.

A context overflow (the proxy's "prompt is too long" / `context_length_exceeded`, a 400) is the run's
limit, like the turn and time limits. Before any call was answered only the harness had spoken (its
own system prompt, tools and the task): the run's config cannot serve it, so the rollout is excluded
with the keys to change. After that the context grew by the policy's replies and the output of the
commands it chose, so the rollout ends there and its workspace is graded as it stands, as after a
timeout: the policy can learn to keep its context short, and a losing rollout cannot get itself
excluded by flooding its own context.
"""

from __future__ import annotations

from typing import Any

from gyre.tasks.grading import Grade


def harness_failure(
    *,
    started: bool,
    returncode: int | None,
    timed_out: bool,
    result: dict[str, Any] | None,
    endpoint_failures: list[str],
    stderr_tail: str,
    context_overflows: list[str] | None = None,
    overflow_before_any_answer: bool = False,
) -> Grade | None:
    """None when the workspace is to be graded (the harness ended normally, timed out or ran out of context
    after the policy had spoken); else the grade. `context_overflows`: the endpoint's record of the proxy's
    context-overflow answers; `overflow_before_any_answer`: one came before any call was answered."""
    if not started:
        return Grade.failed(f"sandbox could not start: {_last_line(stderr_tail)}")
    if overflow_before_any_answer and not endpoint_failures:
        return Grade.failed(
            f"context limit: the harness's first request is over the run's context ({(context_overflows or ['?'])[0]} "
            f"tokens); raise proxy.max_context_tokens, engine.max_context_tokens and model.max_position_embeddings "
            f"or shrink the request (harness.bare=true for claude_code, mini_swe_agent and codex)"
        )
    if timed_out:
        return None
    stop = (result or {}).get("stop_reason")
    if returncode == 0 and result is not None and stop != "api_error":
        return None
    if endpoint_failures:
        return Grade.failed(
            f"infrastructure: {endpoint_failures[-1]} ({len(endpoint_failures)} proxy failures; harness exit code "
            f"{returncode}, {stop or 'no result'})"
        )
    if context_overflows:
        return None  # the policy's own context outgrew the limit: graded as it stands
    errors = (result or {}).get("errors") or []
    why = str(errors[-1]) if errors else _last_line(stderr_tail)
    if returncode != 0:
        return Grade.agent_failed("harness_exit", f"exit code {returncode} ({stop or 'no result'}): {why}")
    if result is None:
        return Grade.agent_failed("harness_protocol", f"exit code 0 without a valid result file: {why}")
    return Grade.agent_failed("harness_protocol", f"reported {stop} but the proxy answered every call: {why}")


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"
