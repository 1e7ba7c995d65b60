"""Policies the production scheduler does not run, simulated to see whether building them would pay.

`CarryAcrossSteps`: partial rollouts carried across a step boundary (Kimi k1.5's partial rollouts, AReaL's
asynchronous steps): a step trains the first `groups_per_step` groups to complete, whatever step admitted
them, so a step's slowest group no longer holds its update back; it is trained in a later step, with
weights one step older than that step's other groups. Admission is unchanged (the staleness gate on the
admitting step). On the recorded benchmark it takes 0-5% off elastic's wall and changes nothing else
(`python -m tools.sim_schedulers --carry`; docs/benchmarks.md), which is why it is not built.
"""

from __future__ import annotations

from gyre.sim.calibrate import RunRecord, run_shape
from gyre.sim.predict import Costs, at_run, workload_of
from gyre.sim.simulator import SimResult, Simulation


class CarryAcrossSteps(Simulation):
    """A completed group joins the oldest open step that still lacks groups, not the step that admitted it."""

    def group_written(self, step: int, group: int) -> None:
        trains_in = min(s for s, left in self.groups_left.items() if left > 0)
        self.ledger.add(trains_in, self.plan_group(step, group))
        self.groups_left[trains_in] -= 1


def predict_carrying(costs: Costs, target: RunRecord, scheduler: str) -> SimResult:
    """gyre.sim.predict.predict with groups carried across step boundaries."""
    return CarryAcrossSteps(scheduler, at_run(costs, target), run_shape(target), workload_of(target, costs)).run()
