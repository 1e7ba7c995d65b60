"""Elastic vs colocate vs async on the embedded workload, side by side, at an equal hardware budget.

    python tools/bench_schedulers.py --steps 6 --repeats 2 [--out DIR] [key=value ...]

Each scheduler runs as the real cell job (`python -m launch.run scheduler=...`: mpirun, controller + 3
cells, each rank pinned to the same CPUs by `sched.cpu_sets`, same per-cell session capacity) on the same
seeds, tasks and number of steps. A busy machine must not decide the ranking: the schedulers run
interleaved, one of each per repeat, the order rotated each repeat (colocate, async, elastic; async,
elastic, colocate; ...) so none always runs first or last; figures are medians with their range over the
repeats, and speedups are paired (each repeat's runs side by side, then the median). Every run does the
same work: the policy is frozen (`train.lr=0`: each update computed, applied as zero) and each call is
sampled from a seed of its rollout and prompt (`proxy.sampling_seed`), so every session makes the same calls
and tool calls under every scheduler and in every repeat, and the walls differ by the schedule alone
(`same_work`: the share of rollouts whose sampled tokens equal the first run's; a session elastic moves to
another engine has its prefix computed again there, which can differ in the last bits and flip a token:
3-17 of 192 rollouts a run in the recorded benchmark). With `--learn` the policy
learns as in training, and each run draws its own work: how many tool calls a session makes is the
policy's sample (357-585 tool sleeps a run of 6 steps on the same seeds), so three repeats rank the draws
as much as the schedulers. Beside each wall,
the CPU seconds each component used (controller with harnesses and tools, each cell's ranks, each
engine: sampled from /proc) and the machine's load average while it ran, so that a wall inflated by
other users' load shows as such. The workload has long-tail rollouts whose wall
time is mostly harness tool time (tasks.tool_time_s, a per-rollout lognormal factor seeded by the
rollout id, identical across schedulers). Reported: the controller's wall clock per run (startup
excluded; the same for all), final scores, median switch latency each way, and prefill tokens
recomputed on reroute (with KV migration; and what they would have been without, as measured by the
engines' prefix caches when the keys/values arrived), and each scheduler's distance from the lower bound
no scheduler can beat on the run's workload (`over_bound`: the median of wall / bound; gyre.sim.bound on
the run's own sessions, at costs fitted from every run of the benchmark: `add_bounds`). Extra `key=value`
arguments go to every run.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gyre.config.schema import CELL_SCHEDULERS

ROOT = Path(__file__).resolve().parents[1]
SCHEDULERS = tuple(s.value for s in CELL_SCHEDULERS)
WORKLOAD = [
    "rl.groups_per_step=4",
    "rl.group_size=8",
    "harness.max_turns=6",
    "harness.temperature=1.6",  # spread of rewards within a group: something to train
    "tasks.tool_time_s=2.0",
    # per-rollout factor ~ lognormal(sigma): at 0.5 the slowest of 32 rollouts takes ~2.5x the mean, and
    # session capacity binds; at 1.0 (~7x) each step waits on its one slowest rollout whatever the scheduler
    # (staleness 1 admits step s+2 only once step s is trained): pass tasks.tool_time_sigma=1.0 to see it
    "tasks.tool_time_sigma=0.5",
    "sched.capacity_per_cell=4",  # 32 sessions a step outnumber even the whole pool (12): capacity binds
    "sched.staleness=1",
    "seed=0",
]
# the same work in every run (unless --learn): a frozen policy, each call sampled from its own seed
SAME_WORK = ["train.lr=0", "proxy.sampling_seed=0"]


# Equal hardware budget two ways. shared3: three cells share the CPUs (cells 0 and 2 on CPU 0, cell 1 on
# CPU 1), so a cell that idles leaves its CPU to the others whatever the scheduler. disjoint2: each of two
# cells owns one CPU, as a cell owns its GPUs on a cluster: what a static split leaves idle stays idle.
LAYOUTS = {
    "shared3": [],
    "disjoint2": ["cluster.satellites=[{}]", "sched.cpu_sets=[0-1,0,1]", "sched.capacity_per_cell=6"],
}


def run_once(scheduler: str, steps: int, out: Path, extra: list[str]) -> dict[str, Any]:
    args = [f"scheduler={scheduler}", f"steps={steps}", *WORKLOAD, *extra]
    args += [f"output_dir={out}", f"hydra.run.dir={out}/hydra"]
    start = time.monotonic()
    cmd = [sys.executable, "-m", "launch.run", *args]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        with CpuSampler(proc.pid) as cpu:
            stdout, stderr = proc.communicate()
    total = time.monotonic() - start
    out.mkdir(parents=True, exist_ok=True)  # a run that failed before making its output directory
    (out / "bench.log").write_text(stdout + stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{scheduler} failed (exit {proc.returncode}); see {out / 'bench.log'}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r["event"] == "step"]
    switches = [r for r in rows if r["event"] == "switch" and not r["initial"]]
    return {
        "scheduler": scheduler,
        "wall_s": summary["wall_s"],
        "job_s": round(total, 1),
        "final_reward": summary["final_reward"],
        "mean_reward": statistics.fmean(r["reward_mean"] for r in steps_rows),
        "switch_s": {
            d: [r["latency_s"] for r in switches if r["direction"] == d] for d in ("rollout->train", "train->rollout")
        },
        "recomputed_tokens": summary["continued_recomputed_tokens"],
        "continued_calls": summary["continued_calls"],
        "migrated_sessions": summary["migrated_sessions"],
        "migrated_idle_sessions": summary.get("migrated_idle_sessions", 0),
        "same_engine_followups": same_engine_followups(out / "calls.jsonl"),
        "would_recompute_tokens": summary["would_recompute_tokens"],
        "rollout_wall_max_s": max(r["rollout_wall_max_s"] for r in steps_rows),
        "sampled": sampled_tokens(out / "calls.jsonl"),
        "role_seconds": summary["role_seconds"],
        "cpu_s": cpu.seconds(),
        "cpu_wait_s": cpu.seconds(waited=True),
        "load_avg": cpu.load_avg(),
        "out": str(out),
    }


class CpuSampler:
    """CPU seconds of a run's processes by component (`component_of`), read from /proc every `every_s` while
    it runs, and the seconds their threads stood runnable waiting for a CPU (schedstat's run-queue wait): a
    component that waits long shares its CPU with others. A process's last fraction of a poll before it exits
    is not seen (a lower bound: short-lived harness tools lose the most); the 1-minute load average is sampled
    alongside."""

    def __init__(self, root_pid: int, every_s: float = 0.5) -> None:
        self.root_pid, self.every_s = root_pid, every_s
        self.seen: dict[int, tuple[str, float, float]] = {}  # pid -> (component, CPU seconds, run-queue wait s)
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(self.every_s):
            self.loads.append(os.getloadavg()[0])
            for pid, (component, ticks) in process_tree(self.root_pid).items():
                self.seen[pid] = (component, ticks / tick, run_queue_wait_s(pid))

    def seconds(self, waited: bool = False) -> dict[str, float]:
        """CPU seconds by component; with `waited`, seconds runnable and waiting for a CPU."""
        out: dict[str, float] = {}
        for component, secs, wait in self.seen.values():
            out[component] = out.get(component, 0.0) + (wait if waited else secs)
        return {k: round(v, 1) for k, v in sorted(out.items())}

    def load_avg(self) -> dict[str, float]:
        return spread(self.loads) if self.loads else {}


def process_tree(root: int) -> dict[int, tuple[str, int]]:
    """pid -> (component, utime + stime ticks) of `root` and its descendants (gone ones skipped)."""
    stats: dict[int, tuple[int, int, str, str]] = {}  # pid -> (ppid, ticks, MPI rank or "", cmdline)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            rank = _pmi_rank(entry)
        except OSError:
            continue
        stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), rank, cmdline)
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, tuple[str, int]] = {}
    todo = [(root, "launcher")]
    while todo:
        pid, parent = todo.pop()
        if pid in stats:
            _, ticks, rank, cmdline = stats[pid]
            label = component_of(cmdline, rank, parent)
            out[pid] = (label, ticks)
            todo += [(child, label) for child in children.get(pid, [])]
    return out


def run_queue_wait_s(pid: int) -> float:
    """Seconds the process's live threads have stood runnable, waiting for a CPU (/proc/PID/task/*/schedstat's
    second field: a thread that has exited no longer counts; 0.0 when the process is gone or the kernel keeps
    no schedstats)."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def _pmi_rank(proc_dir: Path) -> str:
    for var in (proc_dir / "environ").read_bytes().split(b"\0"):
        if var.startswith(b"PMI_RANK="):
            return var.split(b"=", 1)[1].decode()
    return ""


def component_of(cmdline: str, rank: str, parent: str) -> str:
    """A process's component from its command line, its MPI rank (PMI_RANK, "" when its environment has
    none: a sandboxed harness) and its parent's component: a rank's own process is the controller (rank 0)
    or a cell (cell@rank<r>), an engine is its rank's engine (engine@rank<r>), what the controller starts
    (proxy helpers, harnesses, tools, graders) is "harnesses", anything else its parent's component
    (mpirun and the launcher: "launcher")."""
    if "gyre.engine.server" in cmdline or "sglang.launch_server" in cmdline:
        return f"engine@rank{rank or parent.rpartition('rank')[2]}"
    if rank and "gyre.sched.launch" in cmdline:
        return "controller" if rank == "0" else f"cell@rank{rank}"
    return "harnesses" if parent == "controller" else parent


def run_order(schedulers: list[str], repeat: int) -> list[str]:
    """Repeat r runs the schedulers rotated by r: each runs first, middle and last as often as the others."""
    k = repeat % len(schedulers)
    return schedulers[k:] + schedulers[:k]


def spread(values: list[float]) -> dict[str, float]:
    """Median with its range: what a reader needs to see whether two schedulers' figures overlap."""
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def paired_speedups(results: dict[str, list[dict[str, Any]]], of: str = "elastic") -> dict[str, dict[str, float]]:
    """other's wall / `of`'s wall per repeat (runs of one repeat ran side by side, under the same load),
    then their spread; repeats where either is missing are skipped."""
    out = {}
    for other, runs in results.items():
        if other == of or of not in results:
            continue
        ratios = [o["wall_s"] / e["wall_s"] for o, e in zip(runs, results[of], strict=False)]
        if ratios:
            out[other] = spread(ratios)
    return out


def add_bounds(results: dict[str, list[dict[str, Any]]]) -> None:
    """Each run's lower bound (gyre.sim.bound) on its own workload, at costs fitted from every run of the
    benchmark (gyre.sim.predict.fit_costs): the same costs for every scheduler, so that one which slows its
    engines or harnesses does not raise its own bound. The workload is the run's own: how many tool calls
    its sessions make is the policy's draw, and differs between runs of one scheduler."""
    from gyre.sim.calibrate import read_run
    from gyre.sim.predict import fit_costs, run_bound

    records = {r["out"]: read_run(Path(r["out"])) for runs in results.values() for r in runs}
    costs = fit_costs(list(records.values()))
    for runs in results.values():
        for r in runs:
            r["bound_s"] = round(run_bound(costs, records[r["out"]]), 3)


def calls_by_rollout(calls_jsonl: Path) -> dict[str, list[dict[str, Any]]]:
    """rollout id -> its calls (the run's calls.jsonl rows) in the order it made them (call ids number the
    run's calls in the order they arrived)."""
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for line in calls_jsonl.read_text().splitlines():
        row = json.loads(line)
        by_rollout.setdefault(row["rollout_id"], []).append(row)
    return {rid: sorted(calls, key=lambda c: c["call_id"]) for rid, calls in sorted(by_rollout.items())}


def sampled_tokens(calls_jsonl: Path) -> dict[str, str]:
    """rollout id -> a digest of the tokens its calls sampled, in call order: two runs did the same work
    where their digests agree."""
    digest = lambda calls: hashlib.blake2b(json.dumps([c["output_ids"] for c in calls]).encode(), digest_size=8)  # noqa: E731
    return {rid: digest(calls).hexdigest() for rid, calls in calls_by_rollout(calls_jsonl).items()}


def same_work(results: dict[str, list[dict[str, Any]]]) -> float:
    """The share of rollouts, over every run, whose sampled tokens equal the first run's (1.0: every run
    did the same work)."""
    runs = [r["sampled"] for rs in results.values() for r in rs]
    first = runs[0]
    same = sum(1 for run in runs for rid, digest in run.items() if first.get(rid) == digest)
    return round(same / sum(len(run) for run in runs), 4)


def same_engine_followups(calls_jsonl: Path) -> float:
    """Share of a session's calls after its first that ran on the engine of its previous call (its
    context cached there, or moved there with the session)."""
    pairs = [pair for calls in calls_by_rollout(calls_jsonl).values() for pair in itertools.pairwise(calls)]
    moved = sum(1 for a, b in pairs if a["engine_url"] != b["engine_url"])
    return round(1 - moved / len(pairs), 3) if pairs else 1.0


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def by_component(runs: list[dict[str, Any]], key: str) -> dict[str, dict[str, float]]:
    """Each component's spread over the runs of `runs[i][key]` (a run without the key, or without the component,
    counts 0.0)."""
    components = sorted({c for r in runs for c in r.get(key, {})})
    return {c: spread([r.get(key, {}).get(c, 0.0) for r in runs]) for c in components}


def report(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for sched, runs in results.items():
        lat = {d: [x for r in runs for x in r["switch_s"][d]] for d in ("rollout->train", "train->rollout")}
        table[sched] = {
            "wall_s": median_of(runs, "wall_s"),
            "job_s": median_of(runs, "job_s"),
            "final_reward": median_of(runs, "final_reward"),
            "mean_reward": median_of(runs, "mean_reward"),
            "switch_median_s": {d: round(statistics.median(v), 3) if v else None for d, v in lat.items()},
            "switches": {d: len(v) for d, v in lat.items()},
            "recomputed_tokens": sum(r["recomputed_tokens"] for r in runs),
            "would_recompute_tokens": sum(r["would_recompute_tokens"] for r in runs),
            "rerouted_calls": sum(r["continued_calls"] for r in runs),
            "migrated_idle_sessions": sum(r["migrated_idle_sessions"] for r in runs),
            "same_engine_followups": statistics.median(r["same_engine_followups"] for r in runs),
            "walls": [r["wall_s"] for r in runs],
            "wall_spread_s": spread([r["wall_s"] for r in runs]),
            "cpu_s": by_component(runs, "cpu_s"),
            "cpu_wait_s": by_component(runs, "cpu_wait_s"),
            "bound_s": statistics.median(r["bound_s"] for r in runs),
            "over_bound": round(statistics.median(r["wall_s"] / r["bound_s"] for r in runs), 3),
        }
    table["same_work"] = same_work(results)
    for other, ratios in paired_speedups(results).items():
        table[f"elastic_speedup_vs_{other}"] = ratios["median"]
        table[f"elastic_speedup_vs_{other}_spread"] = ratios
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--schedulers", default=",".join(SCHEDULERS))
    p.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default="shared3",
        help="shared3: 3 cells sharing this machine's CPUs (the default mapping); disjoint2: 2 cells, one CPU each",
    )
    p.add_argument("--out", default=f"outputs/bench_schedulers_{time.strftime('%Y%m%d_%H%M%S')}")
    p.add_argument(
        "--learn",
        action="store_true",
        help="the policy learns (train.lr as configured, calls unseeded): each run draws its own work",
    )
    args, extra = p.parse_known_args()
    if flags := [a for a in extra if a.startswith("-")]:
        p.error(f"unrecognized arguments: {' '.join(flags)} (extra arguments are key=value overrides for every run)")
    if args.steps < 1 or args.repeats < 1:
        p.error(f"--steps and --repeats must be at least 1 (got {args.steps} and {args.repeats})")
    chosen = args.schedulers.split(",")
    if unknown := [s for s in chosen if s not in SCHEDULERS]:
        p.error(f"--schedulers: no {', '.join(unknown)} (the cell schedulers are {', '.join(SCHEDULERS)})")
    if len(set(chosen)) < len(chosen):
        p.error(f"--schedulers names one twice: {args.schedulers}")
    extra = [*LAYOUTS[args.layout], *([] if args.learn else SAME_WORK), *extra]
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {s: [] for s in chosen}
    for rep in range(args.repeats):
        for sched in run_order(list(results), rep):
            res = run_once(sched, args.steps, root / f"{sched}-{rep}", extra)
            results[sched].append(res)
            print(f"{sched:15s} run {rep}: {res['wall_s']:7.1f} s  reward {res['final_reward']:.3f}", flush=True)
            (root / "progress.json").write_text(json.dumps(results, indent=1))  # a stopped benchmark keeps its runs
    add_bounds(results)
    table = report(results)
    meta = {"workload": WORKLOAD, "layout": args.layout, "extra": extra, "steps": args.steps}
    (root / "results.json").write_text(json.dumps({"runs": results, "table": table, **meta}, indent=1))
    print(json.dumps(table, indent=1))
    print(f"bench_schedulers: results in {root / 'results.json'}")


if __name__ == "__main__":
    main()
