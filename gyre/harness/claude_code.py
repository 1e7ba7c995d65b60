"""Claude Code (the real `claude` CLI from npm) as a black-box harness, offline, against the proxy.

The runner starts `python -m gyre.harness.claude_code ...` (gyre.harness.kinds.claude_code_command);
this wrapper runs `claude -p <task prompt>` in the workspace with a private HOME, no network traffic besides the
proxy, and the rollout id in the base-URL path (`<proxy>/rollout/<id>`, which sub-agents inherit),
then turns Claude Code's JSON result into the runner's result file (turns, stop reason, errors).

The prompt goes in as stream-json user messages, so one session can take follow-ups. Environment
knobs: GYRE_CLAUDE_BIN (the CLI; default `.gyre/node/node_modules/.bin/claude`, installed by
tools/setup_env.sh), GYRE_CLAUDE_FOLLOW_UPS (a JSON list of user messages sent after the task prompt,
each once the previous one is done), GYRE_CLAUDE_TRACE (a file: run the CLI under `strace` and log
every socket connect/send, to check that nothing leaves loopback), GYRE_API_KEY (the rollout's key,
sent as ANTHROPIC_API_KEY). CLAUDE_* variables pass through.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gyre.harness.wrapper_args import wrapper_parser

CLAUDE_CODE_VERSION = "2.1.197"  # the npm version tools/setup_env.sh installs and the tests ran against
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN = REPO_ROOT / ".gyre" / "node" / "node_modules" / ".bin" / "claude"
OFFLINE_ENV = {
    "IS_SANDBOX": "1",  # allows --dangerously-skip-permissions as root
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",  # else a per-task billing line leads the system prompt
    "ANTHROPIC_API_KEY": "gyre-local",
    "NO_PROXY": "127.0.0.1,localhost",
}
DROPPED_PREFIXES = ("ANTHROPIC_", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
TRACED_SYSCALLS = "trace=connect,sendto,sendmsg,sendmmsg"


def claude_bin() -> Path:
    path = Path(os.environ.get("GYRE_CLAUDE_BIN") or DEFAULT_BIN)
    if not path.exists():
        raise FileNotFoundError(
            f"Claude Code CLI not found at {path}; run `bash tools/setup_env.sh` (needs node >= 18 and npm) "
            f"or set GYRE_CLAUDE_BIN"
        )
    return path


def anthropic_base_url(proxy_url: str, rollout_id: str) -> str:
    """`http://host:port[/v1]` -> `http://host:port/rollout/<id>` (Claude Code appends /v1/messages)."""
    url = proxy_url.rstrip("/").removesuffix("/v1")
    return url if "/rollout/" in url else f"{url}/rollout/{rollout_id}"


def claude_env(proxy_url: str, rollout_id: str, home: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(DROPPED_PREFIXES)}
    env.update(OFFLINE_ENV)
    env["HOME"] = str(home)
    env["ANTHROPIC_BASE_URL"] = anthropic_base_url(proxy_url, rollout_id)
    env["ANTHROPIC_CUSTOM_HEADERS"] = f"X-Rollout-Id: {rollout_id}"
    env["ANTHROPIC_API_KEY"] = env.get("GYRE_API_KEY") or OFFLINE_ENV["ANTHROPIC_API_KEY"]  # the rollout's key
    return env


def claude_args(max_turns: int, bare: bool = False) -> list[str]:
    """`--bare`: a one-line system prompt and three tools (Bash, Edit, Read) instead of ~12k tokens of them."""
    io = ["--input-format", "stream-json", "--output-format", "stream-json", "--verbose"]
    return ["-p", *io, "--dangerously-skip-permissions", "--max-turns", str(max_turns), *(["--bare"] if bare else [])]


def user_lines(prompts: list[str]) -> str:
    """The prompts as Claude Code's stream-json input, one user message a line."""
    return "".join(json.dumps({"type": "user", "message": {"role": "user", "content": p}}) + "\n" for p in prompts)


def _results(stdout: str) -> list[dict[str, Any]]:
    out = []
    for line in stdout.splitlines():
        try:
            message = json.loads(line) if line.startswith("{") else None
        except ValueError:
            continue
        if isinstance(message, dict) and message.get("type") == "result":
            out.append(message)
    return out


def result_summary(stdout: str, returncode: int) -> dict[str, Any]:
    """The runner's result file from Claude Code's stream-json result lines (one per user message).

    An API error that survived Claude Code's retries is "api_error", which gyre.harness.attribution
    judges from the endpoint's record (a proxy failure: excluded; a context overflow: excluded before any
    answer, graded after); running out of turns or output budget is the policy's doing and is graded."""
    results = _results(stdout)
    if not results:
        return {"turns": 0, "stop_reason": "api_error", "errors": [f"claude exited {returncode} without a result"]}
    errors = [str(r.get("result", "")) for r in results if r.get("is_error")]
    failed = [r for r in results if r.get("is_error")]
    last = failed[0] if failed else results[-1]
    if last.get("api_error_status") is not None:
        stop = "api_error"
    elif last.get("is_error"):
        stop = str(last.get("subtype") if last.get("subtype") != "success" else last.get("terminal_reason") or "error")
    else:
        stop = str(last.get("stop_reason") or last.get("terminal_reason") or "completed")
    turns = sum(int(r.get("num_turns", 0)) for r in results)
    return {"turns": turns, "stop_reason": stop, "errors": errors, "claude": results}


def main(argv: list[str] | None = None) -> int:
    args = wrapper_parser(
        "Run Claude Code on one task against the Gyre proxy", "claude --bare: minimal system prompt and tools"
    ).parse_args(argv)
    result_file = Path(args.result_file)
    home = result_file.parent / "claude-home"
    home.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(Path(args.task_file).read_text())["prompt"]]
    prompts += json.loads(os.environ.get("GYRE_CLAUDE_FOLLOW_UPS") or "[]")
    cmd = [str(claude_bin()), *claude_args(args.max_turns, args.bare)]
    trace = os.environ.get("GYRE_CLAUDE_TRACE")
    if trace:
        cmd = ["strace", "-f", "--seccomp-bpf", "-qq", "-e", TRACED_SYSCALLS, "-o", trace, *cmd]
    proc = subprocess.run(
        cmd,
        cwd=args.workspace,
        env=claude_env(args.base_url, args.rollout_id, home),
        input=user_lines(prompts),
        stdout=subprocess.PIPE,
        text=True,
    )
    summary = result_summary(proc.stdout, proc.returncode)
    print(json.dumps(summary.get("claude", [])), flush=True)  # the harness log keeps Claude Code's results
    result_file.write_text(json.dumps(summary))
    return 0 if "claude" in summary else (proc.returncode or 1)


if __name__ == "__main__":
    sys.exit(main())
