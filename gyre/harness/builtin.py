"""The built-in harness: a standalone multi-turn tool-using agent loop over the OpenAI Chat API.

It is a black box to Gyre, like any other harness: it knows the proxy only as an OpenAI base URL
(`http://host:port/v1`) plus its rollout's key (env GYRE_API_KEY, sent as `Authorization: Bearer`) and
an `X-Rollout-Id` header, works only inside its workspace, and
writes a small result file (rewritten after every turn, so a killed run still reports its turns).
Standard library only, to start in ~60 ms.

    python -m gyre.harness.builtin --base-url http://127.0.0.1:8000/v1 --workspace ws \
        --task-file task.json --result-file result.json --rollout-id r1 --max-turns 8
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gyre.harness.tools import SYSTEM_PROMPT, TOOL_SCHEMAS, execute_tool

RETRYABLE = {408, 409, 429, 500, 502, 503, 504, 529}


class ApiError(Exception):
    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def _seconds(header: str | None) -> float | None:
    try:
        return float(header) if header else None
    except ValueError:  # an HTTP date: fall back to our own backoff
        return None


class ChatClient:
    """POST {base_url}/chat/completions with retries on 429/5xx and connection errors."""

    def __init__(self, base_url: str, rollout_id: str, timeout_s: float, max_retries: int) -> None:
        url = urlsplit(base_url.rstrip("/"))
        if url.scheme not in ("http", "https") or not url.hostname:
            raise SystemExit(f"--base-url must look like http://host:port/v1, got {base_url!r}")
        conn_cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._connect = lambda: conn_cls(url.hostname, url.port, timeout=timeout_s)
        self._conn: http.client.HTTPConnection | None = None
        self.path = url.path + "/chat/completions"
        key = os.environ.get("GYRE_API_KEY") or "none"
        self.headers = {
            "Content-Type": "application/json",
            "Authorization": f"Bearer {key}",
            "X-Rollout-Id": rollout_id,
        }
        self.max_retries = max_retries

    def _post_once(self, body: bytes) -> dict[str, Any]:
        if self._conn is None:
            self._conn = self._connect()
        try:
            self._conn.request("POST", self.path, body=body, headers=self.headers)
            resp = self._conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            self._conn = None
            raise ApiError(f"connection error: {type(e).__name__}: {e}") from e
        if resp.status != 200:
            text = data.decode(errors="replace")[:300]
            raise ApiError(f"HTTP {resp.status}: {text}", resp.status, _seconds(resp.getheader("retry-after")))
        try:
            return json.loads(data)["choices"][0]["message"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ApiError(f"malformed chat completion ({type(e).__name__}): {data[:200]!r}", resp.status) from e

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        body = json.dumps(request).encode()
        for attempt in range(self.max_retries + 1):
            try:
                return self._post_once(body)
            except ApiError as e:
                if attempt == self.max_retries or (e.status is not None and e.status not in RETRYABLE):
                    raise
                delay = e.retry_after if e.retry_after is not None else 0.5 * 2**attempt
                time.sleep(min(delay, 30.0))
        raise AssertionError("unreachable")


def rollout_tool_factor(rollout_id: str, sigma: float) -> float:
    """This rollout's tool-time factor: lognormal with mean 1, the same for the same rollout id."""
    return random.Random(rollout_id).lognormvariate(-sigma * sigma / 2, sigma) if sigma > 0 else 1.0


def write_result(path: Path, result: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    task = json.loads(Path(args.task_file).read_text())
    workspace, result_file = Path(args.workspace), Path(args.result_file)
    client = ChatClient(args.base_url, args.rollout_id, args.request_timeout, args.max_retries)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["prompt"]},
    ]
    errors: list[str] = []
    result: dict[str, Any] = {"rollout_id": args.rollout_id, "turns": 0, "tool_calls": 0, "stop_reason": "running"}
    tool_time = args.tool_time * rollout_tool_factor(args.rollout_id, args.tool_time_sigma)
    start = time.monotonic()
    for _ in range(args.max_turns):
        request = {"model": args.model, "messages": messages, "tools": TOOL_SCHEMAS,
                   "max_tokens": args.max_tokens, "temperature": args.temperature}  # fmt: skip
        try:
            reply = client.complete(request)
        except ApiError as e:  # a 400 (e.g. context too long) ends the episode; the rest is infrastructure
            errors.append(str(e))
            result["stop_reason"] = "bad_request" if e.status == 400 else "api_error"
            break
        result["turns"] += 1
        calls = reply.get("tool_calls") or []
        messages.append(
            {"role": "assistant", "content": reply.get("content"), **({"tool_calls": calls} if calls else {})}
        )
        if not calls:
            result["stop_reason"] = "no_tool_call"
        for call in calls:
            fn = call.get("function") or {}
            time.sleep(tool_time)
            outcome = execute_tool(
                workspace, fn.get("name", ""), fn.get("arguments"), task["visible_checks"], args.tool_delay
            )
            result["tool_calls"] += 1
            if outcome.finished:
                result["stop_reason"] = "finish"
                break
            if outcome.error:
                errors.append(outcome.text)
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": outcome.text})
        result.update(errors=errors[-20:], wall_s=round(time.monotonic() - start, 3))
        write_result(result_file, result)
        if result["stop_reason"] != "running":
            break
    else:
        result["stop_reason"] = "max_turns"
    result.update(errors=errors[-20:], wall_s=round(time.monotonic() - start, 3))
    write_result(result_file, result)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Gyre's built-in tool-using agent harness (OpenAI Chat Completions).")
    p.add_argument("--base-url", required=True, help="OpenAI base URL including /v1")
    p.add_argument("--workspace", required=True)
    p.add_argument("--task-file", required=True, help="JSON with prompt and visible_checks")
    p.add_argument("--result-file", required=True)
    p.add_argument("--rollout-id", default="")
    p.add_argument("--model", default="policy")
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--tool-delay", type=float, default=0.0, help="seconds run_checks sleeps (emulates slow tools)")
    p.add_argument("--tool-time", type=float, default=0.0, help="mean seconds every tool call takes (slow tools)")
    p.add_argument("--tool-time-sigma", type=float, default=1.0, help="lognormal spread of --tool-time per rollout")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--max-retries", type=int, default=3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    result = run(parse_args(argv))
    return 1 if result["stop_reason"] == "api_error" else 0


if __name__ == "__main__":
    sys.exit(main())
