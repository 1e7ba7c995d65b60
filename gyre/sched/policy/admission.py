"""Which queued session takes a freed slot: the group that looks longest first (Seer's within-group length
prediction), or the order they were submitted in.

A step's sessions are its groups' rollouts, `rl.group_size` of one task each. How long a rollout runs is
unknown while it is queued (the policy's draw of how many turns, its tools' time), but rollouts of one task
run alike: in the recorded benchmark the group accounts for 16-26% of the variance of a session's seconds
(tools/bench_schedulers.py, disjoint2, both tails). When sessions queue for slots, the step's last one to start
is often what ends the step, and the step's update gates the admission of later steps (sched.staleness), so
`group_length` starts the longest-looking work first:
- the oldest step first (its update comes first);
- in it, a group none of whose rollouts has started yet (its probe: a group's length shows only once one
  of its rollouts runs);
- then the group whose rollouts have run longest (a finished one's seconds, a running one's so far);
- ties in the order submitted.
On the 6-step tails of the recorded benchmarks the simulator (gyre.sim, which calls this) puts elastic 5-12%
faster than in submission order (`fifo`), async 5-9%, colocate_cells within 4% either way
(`python -m tools.sim_schedulers --admission`; docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gyre.config.schema import Admission  # declared with the config field

GroupKey = tuple[int, int]  # (step, group)


@dataclass
class _Group:
    running: dict[str, float] = field(default_factory=dict)  # session id -> started at
    longest_done: float = 0.0  # seconds of its longest finished session
    done: int = 0

    def seen_s(self, now: float) -> float:
        """How long its rollouts have been seen to run: its longest finished one, or running one so far."""
        return max([self.longest_done, *(now - t for t in self.running.values())])


class AdmissionOrder:
    """The admission rule with what it has seen of each group (started and ended sessions). Not
    thread-safe: the rollout driver calls it under its lock."""

    def __init__(self, rule: str = Admission.group_length) -> None:
        if rule not in tuple(Admission):
            raise ValueError(f"sched.admission={rule!r}: one of {', '.join(Admission)}")
        self.rule = rule
        self._groups: dict[GroupKey, _Group] = {}

    def started(self, key: GroupKey, session: str, now: float) -> None:
        self._groups.setdefault(key, _Group()).running[session] = now

    def ended(self, key: GroupKey, session: str, now: float) -> None:
        """The session's slot was freed (its harness ended, or it failed): its seconds so far are its length."""
        group = self._groups.get(key)
        if group is None or session not in group.running:
            return
        group.longest_done = max(group.longest_done, now - group.running.pop(session))
        group.done += 1

    def forget_before(self, step: int) -> None:
        """Drop what was seen of steps before `step` once none of their sessions can queue again."""
        for key in [k for k, g in self._groups.items() if k[0] < step and not g.running]:
            del self._groups[key]

    def pick(self, queued: Sequence[GroupKey], now: float) -> int:
        """The index in `queued` (in submission order) of the session to start next."""
        if self.rule == Admission.fifo or len(queued) < 2:
            return 0
        return min(range(len(queued)), key=lambda i: self._rank(queued[i], now) + (i,))

    def _rank(self, key: GroupKey, now: float) -> tuple[int, int, float]:
        group = self._groups.get(key)
        if group is None or (not group.running and not group.done):
            return (key[0], 0, 0.0)
        return (key[0], 1, -group.seen_s(now))
