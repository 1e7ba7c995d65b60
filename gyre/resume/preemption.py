"""Turning SIGTERM and SIGUSR1 into a clean stop: abandon what can be re-run, finish what cannot.

Slurm sends SIGTERM on preemption, on `scontrol requeue` and (with `--signal=B:TERM@grace`, which
the generated scripts request) before the time limit; SIGUSR1 is there for users' own tooling.
Outside a `deferred()` section the first such signal raises `Preempted` at once, which unwinds
rollouts in flight (engines, proxy and harnesses stop). Inside one (an optimizer update, a
checkpoint write) it is only noted; the caller checks `requested` when the section ends.
SIGINT (Ctrl-C) still stops at once without a checkpoint, as before: the last one written stands.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: checkpointed, run the same command again to continue
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(KeyboardInterrupt):
    """The run was asked to stop by a signal. A KeyboardInterrupt so that no `except Exception` in
    harness or server code swallows it and asyncio.run re-raises it at once instead of waiting for
    the current task."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"gyre: stopped by {signal_name}")
        self.signal_name = signal_name


class PreemptionGuard:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self.section_failed = False  # a deferred section raised: what it guarded may be half done
        self._deferred = 0

    def install(self) -> PreemptionGuard:
        """Handle SIGTERM/SIGUSR1 (and SIGINT) from now on; call from the main thread."""
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._on_signal)
        signal.signal(signal.SIGINT, _interrupt)
        return self

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A section a stop signal must not cut: it only sets `requested`."""
        self._deferred += 1
        try:
            yield
        except BaseException:
            self.section_failed = True
            raise
        finally:
            self._deferred -= 1

    def raise_if_requested(self) -> None:
        if self.signal_name is not None:
            raise Preempted(self.signal_name)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal_name is not None:
            return  # already stopping: Slurm signals every process and the batch shell forwards another
        self.signal_name = signal.Signals(signum).name
        when = "after the current update" if self._deferred else "now, abandoning rollouts in flight"
        # os.write, not print: a handler may run in the middle of another print to the same stream
        os.write(2, f"\ngyre: {self.signal_name} received: checkpointing and stopping {when}\n".encode())
        if not self._deferred:
            raise Preempted(self.signal_name)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    """A plain Python handler rather than the default one: asyncio.run replaces the default SIGINT
    handler with one that only cancels the current task, which a step in progress outlives."""
    raise KeyboardInterrupt(f"gyre: stopped by {signal.Signals(signum).name}")
