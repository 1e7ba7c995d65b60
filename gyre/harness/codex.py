"""Codex CLI (npm `@openai/codex`, a native binary in the package) as a black-box harness against the proxy.

The runner starts `python -m gyre.harness.codex ...` (gyre.harness.kinds.codex_command); this wrapper runs
`codex exec --json <task prompt>` in the workspace on a model provider that is the proxy's Responses API
(`wire_api = "responses"`, the rollout id in the base-URL path), with a private CODEX_HOME beside the result
file (no login: the key comes from GYRE_API_KEY), no update check or analytics, and its own sandbox off (it
runs inside Gyre's). What the proxy cannot serve is switched off rather than refused on every call: the hosted
web_search tool, the multi-agent tools (sent as a `namespace` tool), goals and image generation.
Codex has no turn limit of its own: the wrapper reads its JSON event stream and ends it once it has run
`--max-turns` commands (stop reason "max_turns"), then writes the runner's result file.

`--bare` (harness.bare=true) is Codex's own configuration for a short first request: `model_instructions_file`
holding one line (BARE_INSTRUCTIONS) instead of its ~17 KB of base instructions, no environment-context
message, no view_image tool; its tools (exec_command, write_stdin, request_user_input), the tool loop and
the output it sends back stay the stock CLI's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gyre.harness.wrapper_args import wrapper_parser

CODEX_VERSION = "0.171.0"  # the npm version tools/setup_env.sh installs and the tests ran against
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BIN = REPO_ROOT / ".gyre" / "node" / "node_modules" / ".bin" / "codex"
DISABLED_FEATURES = ("multi_agent", "goals", "image_generation")
BARE_DISABLED_FEATURES = ("view_image",)
PROVIDER = "gyre"
MODEL = "gyre-policy"  # any name: the proxy serves every model name as the policy
BARE_INSTRUCTIONS = "You are a coding agent. Run shell commands with exec_command in the working directory.\n"
HOME_DIR = "codex-home"  # CODEX_HOME, beside the result file


def codex_bin() -> Path:
    path = Path(os.environ.get("GYRE_CODEX_BIN") or DEFAULT_BIN)
    if not path.exists():
        raise FileNotFoundError(
            f"Codex CLI not found at {path}; run `bash tools/setup_env.sh` (needs node and npm) or set GYRE_CODEX_BIN"
        )
    return path


def responses_base_url(proxy_url: str, rollout_id: str) -> str:
    """`http://host:port[/v1]` -> `http://host:port/rollout/<id>/v1` (Codex appends /responses)."""
    url = proxy_url.rstrip("/").removesuffix("/v1")
    return f"{url}/v1" if "/rollout/" in url else f"{url}/rollout/{rollout_id}/v1"


def codex_config(base_url: str, instructions_file: Path | None = None, bare: bool = False) -> dict[str, str]:
    """`-c key=value` overrides (values in TOML): the proxy as the only model provider, nothing else on."""
    provider = f"model_providers.{PROVIDER}"
    config = {
        "model_provider": f'"{PROVIDER}"',
        f"{provider}.name": f'"{PROVIDER}"',
        f"{provider}.base_url": f'"{base_url}"',
        f"{provider}.wire_api": '"responses"',
        f"{provider}.env_key": '"GYRE_API_KEY"',
        f"{provider}.request_max_retries": "0",  # the proxy retries engines itself; a 5xx here is final
        f"{provider}.stream_max_retries": "0",
        "check_for_update_on_startup": "false",
        "analytics.enabled": "false",
        "web_search": '"disabled"',  # a hosted tool: the proxy has no search to run, and refuses it
        "include_permissions_instructions": "false",
        "skills.bundled.enabled": "false",
    }
    if instructions_file is not None:  # replaces Codex's ~17 KB of base instructions
        config["model_instructions_file"] = f'"{instructions_file}"'
    if bare:  # the <environment_context> message (cwd, shell, date, timezone, filesystem roots)
        config["include_environment_context"] = "false"
    return config


def codex_exec_args(
    base_url: str, workspace: Path, model: str, instructions_file: Path | None = None, bare: bool = False
) -> list[str]:
    """`codex exec --json` in `workspace`, approvals and Codex's own sandbox off (Gyre's sandbox holds it)."""
    overrides = [arg for k, v in codex_config(base_url, instructions_file, bare).items() for arg in ("-c", f"{k}={v}")]
    features = (*DISABLED_FEATURES, *(BARE_DISABLED_FEATURES if bare else ()))
    disabled = [arg for feature in features for arg in ("--disable", feature)]
    return [
        str(codex_bin()), "exec", "--json", *overrides, *disabled, "-m", model, "--skip-git-repo-check",
        "--dangerously-bypass-approvals-and-sandbox", "-C", str(workspace),
    ]  # fmt: skip


def codex_env(home: Path, api_key: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """A private HOME/CODEX_HOME (no login, no earlier sessions) and no proxy variables."""
    source = os.environ if base is None else base
    env = {k: v for k, v in source.items() if k in ("PATH", "LANG", "TERM", "TMPDIR")}
    env.update(HOME=str(home), CODEX_HOME=str(home), GYRE_API_KEY=api_key, NO_PROXY="127.0.0.1,localhost")
    return env


def session_args(base_url: str, rollout_id: str, workspace: Path, home: Path, bare: bool) -> list[str]:
    """The command line of one rollout's session (the short instructions written into `home` when bare)."""
    instructions = None
    if bare:
        instructions = home / "instructions.md"
        instructions.write_text(BARE_INSTRUCTIONS)
    return codex_exec_args(responses_base_url(base_url, rollout_id), workspace, MODEL, instructions, bare)


class EventTally:
    """What the `codex exec --json` event stream says: commands run, the last message, errors."""

    def __init__(self) -> None:
        self.commands = 0
        self.messages: list[str] = []
        self.errors: list[str] = []
        self.completed = False

    def read(self, line: str) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        if not isinstance(event, dict):
            return
        kind, item = event.get("type"), event.get("item") or {}
        if kind == "item.completed" and item.get("type") == "command_execution":
            self.commands += 1
        elif kind == "item.completed" and item.get("type") == "agent_message":
            self.messages.append(str(item.get("text", "")))
        elif kind in ("turn.failed", "error"):
            error = event.get("error") or {}
            self.errors.append(str(error.get("message", error) if isinstance(error, dict) else error))
        elif kind == "turn.completed":
            self.completed = True


def run_session(argv: list[str], prompt: str, workspace: Path, env: dict[str, str], max_turns: int) -> dict[str, Any]:
    """Run codex to the end of its turn, or stop it after `max_turns` commands; the runner's result."""
    tally = EventTally()
    proc = subprocess.Popen([*argv, prompt], cwd=workspace, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    stopped = False
    for line in proc.stdout:
        tally.read(line)
        if tally.commands >= max_turns and not stopped:
            proc.terminate()
            stopped = True
    returncode = proc.wait()
    turns = tally.commands + len(tally.messages)
    if stopped:
        return {"turns": turns, "stop_reason": "max_turns", "errors": tally.errors}
    if tally.errors and not tally.completed:  # an API error that survived Codex's retries
        return {"turns": turns, "stop_reason": "api_error", "errors": tally.errors}
    if returncode != 0:
        return {"turns": turns, "stop_reason": "error", "errors": [*tally.errors, f"codex exited {returncode}"]}
    return {"turns": turns, "stop_reason": "completed", "errors": [], "last_message": (tally.messages or [""])[-1]}


def main(argv: list[str] | None = None) -> int:
    args = wrapper_parser(
        "Run Codex CLI on one task against the Gyre proxy",
        "one-line instructions, no environment context, no view_image",
    ).parse_args(argv)
    result_file = Path(args.result_file)
    home = result_file.parent / HOME_DIR
    home.mkdir(parents=True, exist_ok=True)
    workspace = Path(args.workspace)
    prompt = json.loads(Path(args.task_file).read_text())["prompt"]
    command = session_args(args.base_url, args.rollout_id, workspace, home, args.bare)
    env = codex_env(home, os.environ.get("GYRE_API_KEY") or "gyre-local")
    summary = run_session(command, prompt, workspace, env, args.max_turns)
    result_file.write_text(json.dumps(summary))
    print(json.dumps(summary), flush=True)
    return 0 if summary["stop_reason"] != "error" else 1


if __name__ == "__main__":
    sys.exit(main())
