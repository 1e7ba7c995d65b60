"""Oracle check of a task suite: `python -m tools.check_tasks PATH [--source harbor|swebench]`.

Runs every task's reference solution and a do-nothing agent through the real grading path
(gyre/tasks/oracle.py) and prints one line per task; exits 1 when any task is broken. PATH is a
directory of Harbor tasks (or one task) or a SWE-bench JSONL file (snapshots in --repos, default
<PATH's dir>/repos). `--commit-id DIR` prints the base_commit a plain-directory snapshot stands for.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gyre.config.schema import SandboxConfig, TaskConfig
from gyre.sandbox import make_sandbox
from gyre.tasks.oracle import check_task
from gyre.tasks.source import load_instances
from gyre.tasks.swebench import plain_executables, plain_snapshot, snapshot_commit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("path", type=Path)
    p.add_argument("--source", choices=["harbor", "swebench"], help="default: swebench for a .jsonl file, else harbor")
    p.add_argument("--repos", default="", help="swebench: directory of repository snapshots")
    p.add_argument("--sandbox", default="bwrap", help="sandbox backend (bwrap, apptainer)")
    p.add_argument("--check-timeout", type=float, default=60.0, help="grading limit of tasks that set none")
    p.add_argument("--jobs", type=int, default=4, help="tasks checked at once (each in its own sandboxes)")
    p.add_argument("--build-images", action="store_true", help="harbor: build each environment/Dockerfile (buildah)")
    p.add_argument("--images", default="", help="with --build-images: directory of base image OCI archives")
    p.add_argument("--commit-id", action="store_true", help="print PATH's commit id as a snapshot; check nothing")
    args = p.parse_args(argv)
    if args.commit_id:
        print(snapshot_commit(plain_snapshot(args.path), plain_executables(args.path)))
        return 0
    source = args.source or ("swebench" if args.path.suffix == ".jsonl" else "harbor")
    tasks = load_instances(
        TaskConfig(
            source=source,
            path=str(args.path.resolve()),
            repos=args.repos,
            split="all",
            build_images=args.build_images,
            images=args.images,
        )
    )
    assert tasks is not None
    sandbox = make_sandbox(SandboxConfig(backend=args.sandbox))
    broken = 0
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:  # the work is in sandboxed subprocesses
        for report in pool.map(lambda t: check_task(t, sandbox, args.check_timeout), tasks):
            broken += report.broken
            print(report.line(), flush=True)
    print(f"{len(tasks) - broken} of {len(tasks)} tasks sound, {broken} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
