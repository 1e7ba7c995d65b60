"""Expected failures and how entry points report them.

An expected failure (a refused config value, a runtime missing on a node, a task suite that cannot run) is a
`UserError`: its message says what to change, so the entry points (launch.run, launch.submit, tools.check_tasks,
the cell job's ranks) print `gyre: <message>` once on stderr and exit with its `exit_code`, without a
traceback. `--verbose` or HYDRA_FULL_ERROR=1 shows the traceback as well. Imports nothing of gyre.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

USER_ERROR_EXIT_CODE = 1  # what `sys.exit("gyre: ...")` gave before; docs/running.md: a stopped run exits 1
VERBOSE_ENV = "GYRE_VERBOSE"  # set by --verbose; inherited by the ranks of a cell job


class UserError(Exception):
    """A failure the user can act on; the message names the key or the setup to change."""

    exit_code = USER_ERROR_EXIT_CODE


def wants_traceback() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or os.environ.get(VERBOSE_ENV) == "1"


def take_verbose_flag(argv: list[str]) -> list[str]:
    """argv without `--verbose`; when it was there, tracebacks are shown (here and in child processes)."""
    if "--verbose" not in argv:
        return argv
    os.environ[VERBOSE_ENV] = "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra's own report then shows the whole stack too
    return [a for a in argv if a != "--verbose"]


def report(error: UserError) -> None:
    print(f"gyre: {error}", file=sys.stderr, flush=True)


@contextmanager
def reported() -> Iterator[None]:
    """Around an entry point's work: a UserError becomes its one line and its exit code."""
    try:
        yield
    except UserError as e:
        if wants_traceback():
            raise
        if e.exit_code == USER_ERROR_EXIT_CODE:  # as sys.exit("gyre: ..."): the interpreter prints it, exits 1
            raise SystemExit(f"gyre: {e}") from None
        report(e)
        raise SystemExit(e.exit_code) from None
