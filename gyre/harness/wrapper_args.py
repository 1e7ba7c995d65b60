"""The command line every harness wrapper (Claude Code, Codex) takes from the rollout runner."""

from __future__ import annotations

import argparse


def wrapper_parser(description: str, bare_help: str) -> argparse.ArgumentParser:
    """--base-url, --rollout-id, --workspace, --task-file, --result-file (required), --max-turns, --bare."""
    p = argparse.ArgumentParser(description=description)
    for name in ("--base-url", "--rollout-id", "--workspace", "--task-file", "--result-file"):
        p.add_argument(name, required=True)
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--bare", action="store_true", help=bare_help)
    return p
