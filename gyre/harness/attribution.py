"""Who a failed rollout's failure belongs to: the infrastructure (excluded) or the agent (scored 0).

Only what the agent cannot forge decides: whether the sandbox came up (the launcher's start signal),
the harness's exit status, and the failures its proxy endpoint saw on the proxy's side. The result
file is the harness's own (agent-writable) report: it may say "api_error", but an API error the
endpoint never saw is the agent's doing, not an exclusion.
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
) -> Grade | None:
    """None when the workspace is to be graded (the harness ended normally, or timed out); else the grade."""
    if not started:
        return Grade.failed(f"sandbox could not start: {_last_line(stderr_tail)}")
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
