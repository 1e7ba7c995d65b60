"""Each harness kind as one object: how it is started, what it gets in its environment, what it leaves behind,
what its requests and demonstrations look like, and what the preflight and the warm start need to know of it.

`harness.kind` (gyre.config.schema.HarnessKind) names one of HARNESSES; the runner, the preflight and the warm
start ask the kind's `HarnessSpec` instead of branching on its name. A new kind is one `HarnessSpec` here (and
a value in HarnessKind).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gyre.config.schema import HarnessKind
from gyre.harness.demos import Demonstration
from gyre.harness.demos import demonstration as builtin_demonstration
from gyre.harness.formats import (
    claude_code_demonstration,
    claude_code_first_request,
    codex_demonstration,
    codex_first_request,
    mini_demonstration,
    mini_first_request,
)
from gyre.harness.mini_swe_agent import venv_python
from gyre.sandbox import Sandbox
from gyre.sandbox.base import GYRE_ROOT, SOURCE_ROOT
from gyre.tasks.task import Task

log = logging.getLogger(__name__)
CLAUDE_TRACE = "claude.trace"  # GYRE_CLAUDE_TRACE inside the sandbox: in the harness directory, copied out after


@dataclass(frozen=True)
class HarnessLaunch:
    """What a harness command is built from; paths are absolute."""

    base_url: str
    rollout_id: str
    workspace: Path
    task_file: Path
    result_file: Path
    max_turns: int
    max_tokens: int
    temperature: float
    tool_delay: float
    tool_time: float = 0.0
    tool_time_sigma: float = 1.0
    python: str = "python3"
    bare: bool = False  # claude_code --bare; mini_swe_agent's compact prompt templates
    compact_tokens: int = 0  # builtin: HarnessConfig's
    subagents: bool = False
    reply_retries: int = 0


def harness_argv(module: str, launch: HarnessLaunch, site: bool = False) -> list[str]:
    """`python -m <module>` with what every harness process gets: proxy URL, rollout id, workspace, files.
    Without `site` (-S) the interpreter skips site-packages and their .pth files, tens of ms of CPU a rollout
    for a wrapper that needs only the standard library and gyre (on PYTHONPATH)."""
    return [
        launch.python, *([] if site else ["-S"]), "-m", module,
        "--base-url", launch.base_url,
        "--rollout-id", launch.rollout_id,
        "--workspace", str(launch.workspace),
        "--task-file", str(launch.task_file),
        "--result-file", str(launch.result_file),
        "--max-turns", str(launch.max_turns),
    ]  # fmt: skip


def builtin_command(launch: HarnessLaunch) -> list[str]:
    return [
        *harness_argv("gyre.harness.builtin", launch),
        "--max-tokens", str(launch.max_tokens),
        "--temperature", str(launch.temperature),
        "--tool-delay", str(launch.tool_delay),
        "--tool-time", str(launch.tool_time),
        "--tool-time-sigma", str(launch.tool_time_sigma),
        "--compact-tokens", str(launch.compact_tokens),
        "--reply-retries", str(launch.reply_retries),
        *(["--subagents"] if launch.subagents else []),
    ]  # fmt: skip


def claude_code_command(launch: HarnessLaunch) -> list[str]:
    """gyre.harness.claude_code; max_tokens/temperature are Claude Code's own."""
    return [*harness_argv("gyre.harness.claude_code", launch), *(["--bare"] if launch.bare else [])]


def mini_swe_agent_command(launch: HarnessLaunch) -> list[str]:
    """gyre.harness.mini_swe_agent, run by the interpreter of its own venv."""
    return [
        *harness_argv("gyre.harness.mini_swe_agent", launch, site=True),  # its venv's packages
        "--max-tokens", str(launch.max_tokens),
        "--temperature", str(launch.temperature),
        *(["--bare"] if launch.bare else []),
    ]  # fmt: skip


def codex_command(launch: HarnessLaunch) -> list[str]:
    """gyre.harness.codex; Codex sends no max_tokens or temperature: the proxy's defaults and caps apply."""
    return [*harness_argv("gyre.harness.codex", launch), *(["--bare"] if launch.bare else [])]


def sandbox_python(sandbox: Sandbox) -> str:
    return sandbox.python


def mini_swe_agent_python(sandbox: Sandbox) -> str:
    """mini-swe-agent has its own venv (its dependencies are not gyre's)."""
    python = venv_python(SOURCE_ROOT)
    if not Path(python).exists():
        raise FileNotFoundError(f"mini-swe-agent is not installed at {python}: run `bash tools/setup_env.sh`")
    return venv_python(GYRE_ROOT) if sandbox.isolated else python


def no_env(harness_dir: str, source: Mapping[str, str]) -> dict[str, str]:
    return {}


def claude_code_env(harness_dir: str, source: Mapping[str, str]) -> dict[str, str]:
    """The CLAUDE_* variables and gyre's Claude Code knobs; a trace inside the harness directory when asked for."""
    names = ("GYRE_CLAUDE_FOLLOW_UPS", "GYRE_CLAUDE_BIN")
    env = {k: v for k, v in source.items() if k.startswith("CLAUDE_") or k in names}
    if source.get("GYRE_CLAUDE_TRACE"):
        env["GYRE_CLAUDE_TRACE"] = f"{harness_dir}/{CLAUDE_TRACE}"
    return env


def no_trace(harness_dir: Path) -> None:
    return None


def copy_out_claude_trace(harness_dir: Path) -> None:
    target = os.environ.get("GYRE_CLAUDE_TRACE")
    if not target:
        return
    try:  # the harness directory is the agent's: whatever it left there must not stop the run
        shutil.copyfile(harness_dir / CLAUDE_TRACE, target, follow_symlinks=False)
    except OSError as e:
        log.warning("no Claude Code trace copied from %s: %s", harness_dir, e)


def builtin_demo(task: Task, bare: bool, date: str | None) -> Demonstration:
    return builtin_demonstration(task)


def mini_demo(task: Task, bare: bool, date: str | None) -> Demonstration:
    return mini_demonstration(task, bare)


def codex_env(harness_dir: str, source: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in source.items() if k == "GYRE_CODEX_BIN"}


def builtin_first_request(task: Task, bare: bool) -> Demonstration:
    demo = builtin_demonstration(task)
    return Demonstration(demo.messages[:2], demo.tools)


@dataclass(frozen=True)
class HarnessSpec:
    """One harness kind. `demo`/`request` take (task, bare[, date]): the task's reference solution and the
    first request in the kind's own format, as the proxy converts them."""

    name: str
    command: Callable[[HarnessLaunch], list[str]]
    demo: Callable[[Task, bool, str | None], Demonstration] | None = None
    request: Callable[[Task, bool], Demonstration] | None = None
    python: Callable[[Sandbox], str] = sandbox_python  # the interpreter it runs under
    extra_env: Callable[[str, Mapping[str, str]], dict[str, str]] = no_env  # (harness dir inside, host env)
    copy_out_trace: Callable[[Path], None] = no_trace  # after the run, from the harness directory
    # it sends its own max_tokens (Claude Code asks for 64000): a reply takes proxy.default_max_tokens
    own_max_tokens: bool = False
    # its demonstrations differ from the built-in suite's, so the tokenizer's corpus takes them too
    # (Claude Code's prompt would otherwise tokenize at about one character a token)
    demos_in_corpus: bool = True

    @property
    def short_prompt(self) -> bool:
        """harness.bare exists for it (declared with the config field: HarnessKind.short_prompt_kinds)."""
        return self.name in HarnessKind.short_prompt_kinds()

    def demonstration(self, task: Task, *, bare: bool = True, date: str | None = None) -> Demonstration:
        """The reference solution in this kind's request format (`date`: the day Claude Code's prompt names)."""
        if self.demo is None:
            raise ValueError(f"harness.kind={self.name!r} has no demonstration format")
        return self.demo(task, bare, date)

    def first_request(self, task: Task, *, bare: bool = True) -> Demonstration:
        if self.request is None:
            raise ValueError(f"harness.kind={self.name!r} has no request format")
        return self.request(task, bare)

    def env(self, key: str, harness_dir: str, source: Mapping[str, str] | None = None) -> dict[str, str]:
        """Its environment besides the sandbox's allowlist: its rollout key and what the kind adds."""
        return {"GYRE_API_KEY": key, **self.extra_env(harness_dir, os.environ if source is None else source)}


HARNESSES: dict[str, HarnessSpec] = {
    HarnessKind.builtin: HarnessSpec(
        HarnessKind.builtin, builtin_command, builtin_demo, builtin_first_request, demos_in_corpus=False
    ),
    HarnessKind.claude_code: HarnessSpec(
        HarnessKind.claude_code,
        claude_code_command,
        claude_code_demonstration,
        claude_code_first_request,
        extra_env=claude_code_env,
        copy_out_trace=copy_out_claude_trace,
        own_max_tokens=True,
    ),
    HarnessKind.mini_swe_agent: HarnessSpec(
        HarnessKind.mini_swe_agent,
        mini_swe_agent_command,
        mini_demo,
        mini_first_request,
        python=mini_swe_agent_python,
    ),
    HarnessKind.codex: HarnessSpec(
        HarnessKind.codex,
        codex_command,
        codex_demonstration,
        codex_first_request,
        extra_env=codex_env,
        own_max_tokens=True,
    ),
}


def harness_spec(kind: str) -> HarnessSpec:
    if kind not in HARNESSES:
        raise ValueError(f"unknown harness kind {kind!r}; known: {sorted(HARNESSES)}")
    return HARNESSES[kind]
