"""The documentation matches the code: a short README linking every page, links that resolve, the generated
configuration reference, and every command the docs show dry-run (config composed and checked, a tool's
flags known to its --help, a script present)."""

from __future__ import annotations

import contextlib
import functools
import io
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from gyre.config.load import check_overrides, compose, normalize_overrides

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
SHELL_FENCES = {"bash", "sh", "shell", "console", ""}
# words the docs use for "a path of yours": a dry run puts an existing directory there
PLACEHOLDERS = {"DEST", "DIR", "PATH", "RUN_DIR", "OUT", "MIRROR", "ID", "FILE"}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str
    expected_error: str = ""  # a console block shows this `gyre: ...` line after the command: it must fail so

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lstrip("#").strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def commands() -> list[Command]:
    """Shell lines of fenced blocks (a `$ ` prompt marks a command among its output) and inline code that
    starts like a command, in the README and docs/."""
    found: list[Command] = []
    starts = ("python -m ", "python tools/", "make ", "bash tools/", "slurm/cluster.sh", "tools/")
    for page in PAGES:
        fence: str | None = None
        lines = page.read_text().splitlines()
        prompted = False
        for i, line in enumerate(lines, 1):
            if line.startswith("```"):
                fence = None if fence is not None else line[3:].strip()
                prompted = fence is not None and any(
                    x.startswith("$ ") for x in _block(lines, i)
                )  # a console block: only the lines after a prompt are commands
                continue
            if fence is not None:
                text = line.strip()
                if fence not in SHELL_FENCES or not text or text.startswith("#"):
                    continue
                if prompted:
                    if not text.startswith("$ "):
                        continue
                    text = text[2:]
                    shown = lines[i].strip() if i < len(lines) else ""
                    error = shown.removeprefix("gyre: ") if shown.startswith("gyre: ") else ""
                    if text.startswith(starts):
                        found.append(Command(page.name, i, text, error))
                    continue
                if text.startswith(starts):
                    found.append(Command(page.name, i, text))
                continue
            for span in re.findall(r"`([^`]+)`", line):
                if span.startswith(starts) and " " in span:
                    found.append(Command(page.name, i, span))
    return found


def _block(lines: list[str], after: int) -> list[str]:
    out = []
    for line in lines[after:]:
        if line.startswith("```"):
            break
        out.append(line.strip())
    return out


def words(cmd: str) -> list[str]:
    cmd = cmd.split(" # ")[0].split("  #")[0].strip()
    cmd = re.split(r"\s(?:>|\||&&|2>)\s?", cmd)[0]
    try:
        return shlex.split(cmd)
    except ValueError:
        return cmd.split()


def placeholder(arg: str) -> bool:
    """`harness=...`, `tasks.path=<suite>`: a value the reader chooses."""
    return "..." in arg or "<" in arg


def filled(arg: str, tmp: Path) -> str:
    key, sep, value = arg.partition("=")
    if sep and value in PLACEHOLDERS:
        return f"{key}={tmp}"
    return arg


def test_readme_is_short_and_links_every_page() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    unlinked = [p.name for p in DOCS if f"(docs/{p.name}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
    assert readme.index("make run") < 1200 and readme.index("make test") < 1200  # the two commands first


def test_every_link_between_pages_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md":
                anchors = {slug(h) for h in dest.read_text().splitlines() if h.startswith("#")}
                if anchor not in anchors:
                    broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_configuration_reference_is_generated_from_the_schema() -> None:
    from tools.config_reference import OUT, render

    assert OUT.read_text() == render(), "docs/configuration.md is stale: run `python -m tools.config_reference`"


def test_the_docs_show_commands() -> None:
    shown = commands()
    assert len(shown) >= 30
    assert any("launch.submit" in c.text for c in shown) and any("tools.check_tasks" in c.text for c in shown)


def run_overrides(cmd: Command, argv: list[str], tmp: Path) -> None:
    """`python -m launch.run ARGS` / `make run ARGS=...`: the overrides compose into a config that passes
    every check made before a run starts (keys, domains, cross-field rules)."""
    overrides = [filled(a, tmp) for a in argv if not a.startswith(("-", "hydra")) and not placeholder(a)]
    overrides = [a for a in overrides if "=" in a and "," not in a.partition("=")[2]]  # sweeps: each value alone
    overrides = normalize_overrides(overrides)
    check_overrides(overrides)
    compose(overrides)


@pytest.mark.parametrize("cmd", commands(), ids=str)
def test_command_in_the_docs_dry_runs(cmd: Command, tmp_path: Path) -> None:
    argv = words(cmd.text)
    assert argv, cmd
    if argv[0] == "make":
        targets = {m for m in re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)}
        assert argv[1] in targets, f"{cmd}: no make target {argv[1]}"
        if argv[1] == "run":
            extra = next((a.partition("=")[2] for a in argv[2:] if a.startswith("ARGS=")), "")
            run_overrides(cmd, shlex.split(extra), tmp_path)
        return
    if argv[:3] == ["python", "-m", "launch.run"]:
        if cmd.expected_error:  # an example of a refusal: refused with the message shown
            with pytest.raises(Exception) as refused:
                run_overrides(cmd, argv[3:], tmp_path)
            shown = cmd.expected_error.split("...")[0].strip()
            assert shown in str(refused.value), f"{cmd}: refused with {refused.value!r}, the docs show {shown!r}"
            return
        run_overrides(cmd, argv[3:], tmp_path)
        return
    if argv[:3] == ["python", "-m", "launch.submit"]:
        args = [filled(a, tmp_path) for a in argv[3:] if a not in ("--dry-run",)]
        out = subprocess.run(
            [sys.executable, "-m", "launch.submit", "--dry-run", *args, f"output_dir={tmp_path / 'run'}"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, f"{cmd}\n{out.stdout}{out.stderr}"
        assert (tmp_path / "run" / ("gyre-eval.sbatch" if "--eval" in args else "gyre.sbatch")).exists()
        return
    if argv[0] == "python" and (argv[1] == "-m" or argv[1].endswith(".py")):
        module = argv[2] if argv[1] == "-m" else argv[1]
        check_tool_flags(cmd, module, argv[3:] if argv[1] == "-m" else argv[2:])
        return
    if argv[0].endswith(".py"):
        check_tool_flags(cmd, argv[0], argv[1:])
        return
    script = argv[1] if argv[0] == "bash" else argv[0]
    assert (REPO / script).exists(), f"{cmd}: no {script}"
    syntax = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert syntax.returncode == 0, f"{cmd}: {syntax.stderr}"


def check_tool_flags(cmd: Command, module: str, args: list[str]) -> None:
    """A tool the docs show: its --help works and knows every flag the command passes."""
    if not module.endswith(".py") and not module.startswith(("tools.", "gyre.", "launch.")):
        pytest.fail(f"{cmd}: not a module of this repository")
    code, text = tool_help(module)
    assert code == 0, f"{cmd}: --help failed\n{text}"
    flags = {a.split("=")[0] for a in args if a.startswith("--")}
    unknown = sorted(f for f in flags if f not in text)
    assert not unknown, f"{cmd}: flags {unknown} not in `{module} --help`"


@functools.cache
def tool_help(module: str) -> tuple[int, str]:
    """`module --help` run in this process (one import of torch for all tools, not one per tool): its exit
    code and output."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module, "--help"]
    code: int | str | None = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module's package is imported already
            if module.endswith(".py"):
                runpy.run_path(str(REPO / module), run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=False)
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.argv = argv
    return (code or 0) if isinstance(code, int) or code is None else 1, out.getvalue()
