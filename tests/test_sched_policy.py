"""The scheduler policy (colocate, async, elastic in one pure function) and the micro-batch ledger."""

from __future__ import annotations

import pytest

from gyre.comm.messages import MicroBatchRef
from gyre.sched.policy import (
    CellState,
    Load,
    PolicyConfig,
    Switch,
    decide,
    initial_roles,
    may_start,
    session_capacity,
)
from gyre.sched.policy.ledger import LedgerError, MicroBatchLedger, hand_out

pytestmark = pytest.mark.unit


def cells(*roles: str, busy: tuple[int, ...] = (), dead: tuple[int, ...] = ()) -> list[CellState]:
    return [CellState(i, r, i in busy, i not in dead) for i, r in enumerate(roles)]  # type: ignore[arg-type]


ELASTIC = PolicyConfig("elastic", n_cells=3, capacity=4, staleness=1)


def test_elastic_releases_cells_only_when_the_rest_can_serve_every_session_core_first() -> None:
    three = cells("rollout", "rollout", "rollout")
    assert decide(ELASTIC, three, Load(queued=1, running=11)) == []  # 12 sessions need all 3 cells
    assert decide(ELASTIC, three, Load(running=9)) == []  # 9 > 2 cells x 4
    assert decide(ELASTIC, three, Load(running=8)) == [Switch(0, "train")]  # 2 cells serve 8: the core goes
    assert decide(ELASTIC, three, Load(running=3)) == [Switch(0, "train"), Switch(1, "train")]
    assert decide(ELASTIC, three, Load()) == [Switch(0, "train"), Switch(1, "train"), Switch(2, "train")]
    # the core already trains: the next release is the lowest satellite
    assert decide(ELASTIC, cells("train", "rollout", "rollout"), Load(running=2)) == [Switch(1, "train")]


def test_elastic_brings_idle_cells_back_when_sessions_queue_satellites_first() -> None:
    two_train = cells("train", "train", "rollout")
    assert decide(ELASTIC, two_train, Load(running=4)) == []  # full but nothing waits
    assert decide(ELASTIC, two_train, Load(queued=1, running=4)) == [Switch(1, "rollout")]
    assert decide(ELASTIC, two_train, Load(queued=9, running=4)) == [Switch(1, "rollout"), Switch(0, "rollout")]
    # a cell with micro-batches in flight stays in training
    busy = cells("train", "train", "rollout", busy=(1,))
    assert decide(ELASTIC, busy, Load(queued=9, running=4)) == [Switch(0, "rollout")]
    assert decide(ELASTIC, cells("train", "train", "rollout", busy=(0, 1)), Load(queued=9, running=4)) == []


def test_dead_cells_neither_serve_nor_count() -> None:
    state = cells("rollout", "rollout", "rollout", dead=(2,))
    assert session_capacity(ELASTIC, state) == 8
    assert decide(ELASTIC, state, Load(running=8)) == []
    assert decide(ELASTIC, cells("train", "train", "train", dead=(2,)), Load(queued=5)) == [
        Switch(1, "rollout"),
        Switch(0, "rollout"),
    ]


def test_colocate_moves_every_cell_together() -> None:
    p = PolicyConfig("colocate_cells", n_cells=3, capacity=4, staleness=1)
    assert initial_roles(p) == ("rollout", "rollout", "rollout")
    assert decide(p, cells("rollout", "rollout", "rollout"), Load(running=1)) == []
    assert decide(p, cells("rollout", "rollout", "rollout"), Load()) == [Switch(i, "train") for i in range(3)]
    assert decide(p, cells("train", "train", "train"), Load(queued=12)) == [Switch(i, "rollout") for i in range(3)]
    assert decide(p, cells("train", "train", "train", busy=(0,)), Load(queued=1)) == [
        Switch(1, "rollout"),
        Switch(2, "rollout"),
    ]
    assert p.max_lag == 0 and not may_start(p, 1, 0) and may_start(p, 1, 1)


def test_async_is_a_static_split_one_step_off_policy() -> None:
    p = PolicyConfig("async", n_cells=3, capacity=4, staleness=1)
    assert initial_roles(p) == ("train", "rollout", "rollout")
    assert initial_roles(PolicyConfig("async", 4, 4, 1, rollout_cells=1)) == ("train", "rollout", "train", "train")
    assert decide(p, cells("train", "rollout", "rollout"), Load(queued=50)) == []
    assert decide(p, cells("train", "rollout", "rollout"), Load()) == []
    assert may_start(p, 1, 0) and not may_start(p, 2, 0) and may_start(ELASTIC, 3, 2)


def test_policy_config_errors_say_what_to_change() -> None:
    with pytest.raises(ValueError, match="colocate_cells, async, elastic"):
        PolicyConfig("ray", 3, 4, 1)
    with pytest.raises(ValueError, match="async_rollout_cells=3"):
        PolicyConfig("async", 3, 4, 1, rollout_cells=3)
    with pytest.raises(ValueError, match="capacity_per_cell"):
        PolicyConfig("elastic", 3, 0, 1)
    with pytest.raises(ValueError, match="elastic needs at least 2 cells"):
        PolicyConfig("elastic", 1, 4, 1)
    assert PolicyConfig("colocate_cells", 1, 4, 0).colocated  # one cell of many ranks (slurm_gpu_small)


def ref(i: int, tokens: int = 10, shard: str = "a.h5") -> MicroBatchRef:
    return MicroBatchRef(shard, i, tokens)


def test_ledger_hands_out_largest_first_and_closes_a_step_once_all_are_done() -> None:
    book = MicroBatchLedger()
    book.add(0, [ref(0, 5), ref(1, 50), ref(2, 20)])
    book.add(1, [ref(0, 99, "b.h5")])
    assert book.take(0, cell=1) == ref(1, 50) and book.take(0, cell=2) == ref(2, 20)
    assert book.in_flight(1) == 1 and book.open_work(0) == 3 and book.pending(0) == 1
    book.done(1, ref(1, 50))
    with pytest.raises(LedgerError, match="done, but it is assigned on cell 2"):
        book.done(1, ref(2, 20))
    with pytest.raises(LedgerError, match="not done"):
        book.close_step(0)
    book.done(2, ref(2, 20))
    assert book.take(0, cell=1) == ref(0, 5)
    book.done(1, ref(0, 5))
    assert book.take(0, cell=1) is None
    assert book.close_step(0) == {1: 2, 2: 1}
    assert book.total(0) == 0 and book.total(1) == 1
    with pytest.raises(LedgerError, match="added twice"):
        book.add(1, [ref(0, 1, "b.h5")])


def test_hand_out_serves_idle_satellites_before_the_core_then_whoever_has_room() -> None:
    """Cells that have just joined a step get its work first (tests/test_slurm_cell_job.py relies on it)."""
    book = MicroBatchLedger()
    book.add(1, [ref(i, 10 * (i + 1)) for i in range(5)])
    assert [(cell, r.index) for cell, r in hand_out(book, 1, [0, 1, 2], depth=1)] == [(1, 4), (2, 3), (0, 2)]
    assert hand_out(book, 1, [0, 1, 2], depth=1) == []  # every cell holds `depth`
    book.done(2, ref(3, 40))
    assert [(cell, r.index) for cell, r in hand_out(book, 1, [0, 1, 2], depth=1)] == [(2, 1)]


def test_ledger_requeues_everything_a_dead_cell_trained_in_open_steps() -> None:
    book = MicroBatchLedger()
    book.add(0, [ref(i, 10 + i) for i in range(4)])
    a, b, c = book.take(0, 1), book.take(0, 2), book.take(0, 2)
    book.done(2, b)
    book.done(1, a)
    assert sorted(r.index for r in book.fail_cell(2)) == sorted([b.index, c.index])  # done and in flight
    assert book.reassigned[0] == 2 and book.contributors(0) == {1: 1} and book.pending(0) == 3
    while (r := book.take(0, 1)) is not None:
        book.done(1, r)
    assert book.close_step(0) == {1: 4}  # every micro-batch exactly once, all from the survivor


def test_cpu_plan_shares_cpus_among_cells_the_same_way_for_every_scheduler() -> None:
    from gyre.sched.launch.affinity import cpu_plan, parse_cpu_list

    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    assert cpu_plan(4, [0, 1]) == [{0, 1}, {0}, {1}, {0}]  # 2 CPUs, 3 cells: cells 1 and 3 share CPU 0
    assert cpu_plan(3, [0, 1, 2, 3], ["0", "1-2", "3"]) == [{0}, {1, 2}, {3}]
    with pytest.raises(ValueError, match="one per rank"):
        cpu_plan(4, [0, 1], ["0", "1"])
    with pytest.raises(ValueError, match="CPUs \\[7\\]"):
        cpu_plan(2, [0, 1], ["0", "7"])
    with pytest.raises(ValueError, match="not N or N-M"):
        parse_cpu_list("a-b")


def test_fault_specs_are_checked() -> None:
    from gyre.sched.controller.faults import FaultInjector, parse_faults

    (f,) = parse_faults(["kill_cell:2:after_micro_batches:3"])
    assert (f.kind, f.cell, f.n) == ("kill_cell", 2, 3)
    with pytest.raises(ValueError, match="kill_engine:<cell>:after_calls:<n>"):
        parse_faults(["kill_engine:1:after_micro_batches:3"])
    with pytest.raises(ValueError, match="core"):
        FaultInjector(["kill_cell:0:after_micro_batches:1"], 3)
    with pytest.raises(ValueError, match="cells are 0..2"):
        FaultInjector(["kill_engine:5:after_calls:1"], 3)


def test_elastic_gives_waiting_training_work_the_core_when_nobody_trains() -> None:
    three = cells("rollout", "rollout", "rollout")
    (release,) = decide(ELASTIC, three, Load(queued=20, running=12, trainable=3))
    assert release == Switch(0, "train") and release.reason == "training_waits"
    # somebody already trains: the queue keeps the others serving, and the trainer stays while work waits
    one_trains = cells("train", "rollout", "rollout")
    assert decide(ELASTIC, one_trains, Load(queued=20, running=8, trainable=3)) == []
    assert decide(ELASTIC, one_trains, Load(queued=20, running=8)) == [Switch(0, "rollout")]
    # the surplus rule still comes first
    surplus = decide(ELASTIC, three, Load(running=3, trainable=1))
    assert surplus == [Switch(0, "train"), Switch(1, "train")] and {s.reason for s in surplus} == {"surplus"}


def test_elastic_starts_queued_sessions_while_training_waits_on_all_but_two_trainers() -> None:
    four = PolicyConfig("elastic", n_cells=4, capacity=4, staleness=1)
    # the next step's sessions queue while the current step's micro-batches wait: the satellites beyond two serve
    assert decide(four, cells("train", "train", "train", "train"), Load(queued=8, trainable=5)) == [
        Switch(3, "rollout"),
        Switch(2, "rollout"),
    ]
    assert decide(four, cells("train", "train", "train", "train"), Load(queued=3, trainable=5)) == [
        Switch(3, "rollout")
    ]
    # a trainer with work in flight counts among the two that stay
    assert decide(four, cells("train", "train", "train", "train", busy=(0, 1)), Load(queued=12, trainable=5)) == [
        Switch(3, "rollout"),
        Switch(2, "rollout"),
    ]
    # two trainers, or three with one of them already serving: nobody leaves the step while its work waits
    assert decide(ELASTIC, cells("train", "train", "rollout"), Load(queued=5, running=4, trainable=2)) == []
    assert decide(four, cells("train", "train", "rollout", "rollout"), Load(queued=5, running=8, trainable=2)) == []
    # nothing waits to train: every idle trainer serves, the core last
    assert decide(four, cells("train", "train", "train", "train"), Load(queued=16)) == [
        Switch(3, "rollout"),
        Switch(2, "rollout"),
        Switch(1, "rollout"),
        Switch(0, "rollout"),
    ]
    # keep_training = n_cells: the rule before (no trainer leaves while training waits), as the simulator compares
    before = PolicyConfig("elastic", n_cells=4, capacity=4, staleness=1, keep_training=4)
    assert decide(before, cells("train", "train", "train", "train"), Load(queued=8, trainable=5)) == []
    with pytest.raises(ValueError, match="keep_training"):
        PolicyConfig("elastic", 3, 4, 1, keep_training=0)


def test_elastic_frees_the_core_for_the_update_while_it_serves_and_a_satellite_idles() -> None:
    """The update waits (only the core makes it) while the core serves the next step's sessions and the
    satellite that trained the micro-batches sits idle: the satellite comes back first, then the core leaves.
    Before, nothing moved until the sessions drained (a measured run stood 65 s with the update waiting)."""
    two = PolicyConfig("elastic", n_cells=2, capacity=6, staleness=1)
    stuck = cells("rollout", "train")
    (back,) = decide(two, stuck, Load(queued=2, running=6, trainable=1, update=True))
    assert back == Switch(1, "rollout") and back.reason == "update_waits"
    (release,) = decide(two, cells("rollout", "rollout"), Load(queued=2, running=6, trainable=1, update=True))
    assert release == Switch(0, "train") and release.reason == "training_waits"
    assert decide(two, cells("train", "rollout"), Load(queued=2, running=6, trainable=1, update=True)) == []
    # micro-batches waiting (not the update): the satellite takes them where it is
    assert decide(two, stuck, Load(queued=2, running=6, trainable=1)) == []
    # three cells: the core serves, two satellites idle in training: one comes back
    assert decide(ELASTIC, cells("rollout", "train", "train"), Load(running=4, trainable=1, update=True)) == [
        Switch(2, "rollout")
    ]
