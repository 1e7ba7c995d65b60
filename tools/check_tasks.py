"""Oracle check of a task suite: `python -m tools.check_tasks PATH [--jobs N] [--json FILE]`.

Runs every task's reference solution and a do-nothing agent through the real grading path
(gyre/tasks/oracle.py) and prints, per task, the oracle's and the do-nothing agent's scores and a verdict:
sound, broken (with its cause in words, and the last lines of the tests' and the solution's output) or
skipped (a task that cannot be loaded or built, with its cause). No task stops the others. `--json FILE`
writes a list of {task, built, oracle, noop, verdict, cause} (built: null where no image build applies).
Exits 1 when any task is broken or skipped, or (with its one message, no traceback unless --verbose) when
the suite cannot be read or the sandbox cannot run. PATH is a directory of Harbor tasks (or one task) or a
SWE-bench JSONL file (snapshots in --repos, default <PATH's dir>/repos). `--commit-id DIR` prints the
base_commit a plain-directory snapshot stands for.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gyre.config.schema import SandboxConfig, TaskConfig
from gyre.errors import reported, take_verbose_flag
from gyre.sandbox import make_sandbox
from gyre.tasks.oracle import BuildOutcome, EnvironmentBuilder, OracleReport, check_task, no_build, skipped_report
from gyre.tasks.source import read_suite
from gyre.tasks.swebench import plain_executables, plain_snapshot, snapshot_commit


def environment_builder(args: argparse.Namespace) -> EnvironmentBuilder:
    """Whether each task's environment was built before it is checked: nothing to build under the host's /usr
    (built: null); with --build-images every loaded task was built by read_suite (gyre/tasks/images.py), and a
    task whose image could not be built is among the skipped ones, with the builder's cause."""
    return (lambda task: BuildOutcome(True)) if args.build_images else no_build


def check_suite(path: Path, args: argparse.Namespace) -> list[OracleReport]:
    """One report per task of the suite at `path`, in the suite's order: skipped ones first as loaded."""
    source = args.source or ("swebench" if path.suffix == ".jsonl" else "harbor")
    suite = read_suite(TaskConfig(source=source, path=str(path.resolve()), repos=args.repos, split="all",
                                  build_images=args.build_images, images=args.images))  # fmt: skip
    reports = [skipped_report(s) for s in suite.skipped]
    for s in reports:
        print(s.line(), flush=True)
    sandbox = make_sandbox(SandboxConfig(backend=args.sandbox))
    build = environment_builder(args)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # the work is in sandboxed subprocesses
        for report in pool.map(lambda t: check_task(t, sandbox, args.check_timeout, build), suite.tasks):
            print(report.line(), flush=True)
            reports.append(report)
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", type=Path)
    p.add_argument("--source", choices=["harbor", "swebench"], help="default: swebench for a .jsonl file, else harbor")
    p.add_argument("--repos", default="", help="swebench: directory of repository snapshots")
    p.add_argument("--sandbox", default="bwrap", help="sandbox backend (bwrap, apptainer)")
    p.add_argument("--check-timeout", type=float, default=60.0, help="grading limit of tasks that set none")
    p.add_argument("--jobs", type=int, default=4, help="tasks checked at once (each in its own sandboxes)")
    p.add_argument("--json", type=Path, help="write the per-task verdicts here as a JSON list")
    p.add_argument(
        "--build-images", action="store_true", help="build environments: Harbor Dockerfiles, SWE-bench specs"
    )
    p.add_argument("--images", default="", help="with --build-images: directory of base image OCI archives")
    p.add_argument("--commit-id", action="store_true", help="print PATH's commit id as a snapshot; check nothing")
    p.add_argument("--verbose", action="store_true", help="show the traceback of an expected failure too")
    args = p.parse_args(take_verbose_flag(list(sys.argv[1:] if argv is None else argv)))
    with reported():  # no suite at the path, no sandbox here: one message, exit 1
        return run(args)


def run(args: argparse.Namespace) -> int:
    if args.commit_id:
        print(snapshot_commit(plain_snapshot(args.path), plain_executables(args.path)))
        return 0
    reports = check_suite(args.path, args)
    if args.json:
        args.json.write_text(json.dumps([r.to_json() for r in reports], indent=1) + "\n")
    counts = {v: sum(r.verdict == v for r in reports) for v in ("sound", "broken", "skipped")}
    print(f"{counts['sound']} of {len(reports)} tasks sound, {counts['broken']} broken, {counts['skipped']} skipped")
    return 1 if counts["broken"] or counts["skipped"] else 0


if __name__ == "__main__":
    sys.exit(main())
