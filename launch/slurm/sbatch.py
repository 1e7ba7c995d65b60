"""Text of the heterogeneous sbatch script for a config and its planned steps (pure; golden-tested).

Log names avoid `%j` and `%t`: in a heterogeneous job each component expands `%j` to its own id,
and srun's `%t` is offset per component in a step over several components. Step logs are opened
by each task instead, named by `$SLURM_JOB_ID` (the leader's id in every component) and
`$SLURM_PROCID`.

Preemption and requeue: scripts ask for `--requeue` and `--signal=B:TERM@<cluster.preempt_grace_s>`.
That signal reaches only the batch shell, which passes it on to the job's processes; the run
checkpoints and exits with PREEMPTED_EXIT_CODE, and the script then requeues the job, whose same
command resumes from the run's output_dir (gyre/resume). On preemption or `scontrol requeue`,
Slurm signals every process itself and requeues the job. Logs are opened in append mode, and each
start prints SLURM_JOB_ID and SLURM_RESTART_COUNT.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass

from gyre.config.schema import CellResources, ClusterConfig, RunConfig
from gyre.resume.preemption import PREEMPTED_EXIT_CODE
from gyre.sched.launch.pmi_relay import WORLD_NONCE_VAR
from gyre.sched.launch.slurm_env import EXIT_STATUS_VAR, HET_TASKS_VAR, START_ATTEMPT_VAR, WORLD_UP_VAR
from launch.slurm.plan import ComponentLayout, Step, cells, component_layout

LogNames = Callable[[Step], tuple[str, str | None]]
# what gyre.sched.launch.local sets for a local cell job: shards are immutable once published, so HDF5's advisory
# locks only add spurious EAGAIN failures between ranks; Mooncake's INFO lines drown the logs
CELL_JOB_ENV = (
    ("HDF5_USE_FILE_LOCKING", "FALSE"),
    ("MC_LOG_LEVEL", "ERROR"),
)  # step -> (stdout, stderr or None to merge), task-shell syntax
PMI_RELAY_MODULE = "gyre.sched.launch.pmi_relay"
LEFTOVERS_MODULE = "gyre.sched.launch.mpich_leftovers"


def default_log_names(step: Step) -> tuple[str, str | None]:
    return f"${{SLURM_JOB_ID}}_{step.name}_${{SLURM_PROCID}}.out", None


@dataclass(frozen=True)
class ScriptLayout:
    log_dir: str  # absolute; created by the submitter (sbatch opens --output before the script runs)
    config_path: str  # the resolved config the steps read, named in the header
    batch_output: str = "%j_batch.out"  # sbatch patterns, relative to log_dir (component 0's %j)
    batch_error: str | None = None
    log_names: LogNames = default_log_names
    exports: tuple[tuple[str, str], ...] = ()
    # the step is the cell job, whose rank 0 marks the MPI world up: rerun a start that never gets there
    start_guard: bool = False
    stale_on_restart: tuple[str, ...] = ()  # shell globs of a failed start's outputs, removed before the next


def _component_header(cfg: RunConfig, res: CellResources, layout: ComponentLayout | None = None) -> list[str]:
    """A component's request: `layout`'s tasks, CPUs per task and GPUs per node; without, one task of the
    node's CPUs and GPUs (the colocate main job)."""
    layout = layout or ComponentLayout(res.nodes, res.nodes, 1, res.cpus_per_node, res.gpus_per_node)
    options = [("partition", res.partition), *(arg[2:].split("=", 1) for arg in layout.slurm_args())]
    options += [("mem", res.mem), ("time", res.time), ("account", cfg.cluster.account), ("qos", cfg.cluster.qos)]
    return [f"#SBATCH --{key}={shlex.quote(value)}" for key, value in options if value]


def _requeue_header(cluster: ClusterConfig) -> list[str]:
    lines = ["#SBATCH --requeue"] if cluster.requeue else []
    if cluster.preempt_grace_s:
        lines.append(f"#SBATCH --signal=B:TERM@{cluster.preempt_grace_s}")
    return lines


def _start_lines(pids: str, why: str = "the run checkpoints, then exits", as_signal: str = '"$1"') -> list[str]:
    """Log this start; pass TERM/USR1 on to `pids` (an expression expanded when the signal comes), as
    `as_signal` (default: the signal itself)."""
    return [
        'echo "gyre: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname) at $(date +%FT%T)"',
        f"# a stop signal (scancel --signal, --signal=B:...) reaches only this shell: pass it on ({why})",
        "stop_requested=0",
        f"forward_stop() {{ stop_requested=1; kill -{as_signal} {pids} 2>/dev/null || true; }}",
        "trap 'forward_stop TERM' TERM",
        "trap 'forward_stop USR1' USR1",
    ]


def _wait_lines(pid: str) -> list[str]:
    return [
        "status=0",
        f'wait "{pid}" || status=$?',
        "# a trapped signal ends `wait` early while the process still runs: wait again for its exit status",
        f'while kill -0 "{pid}" 2>/dev/null; do status=0; wait "{pid}" || status=$?; done',
    ]


def _controller_status_lines() -> list[str]:
    """The job's status is the one rank 0 recorded (gyre.sched.launch.job): srun's is the worst of its tasks, so a
    satellite killed mid-run (137) would fail a run that finished without it as sched.allow_dead_cells
    allows, and would hide the dead-cells exit (3). No record (rank 0 itself failed): srun's."""
    return [
        "# the job's status is the one the controller decided (rank 0 records it); srun's is its worst task's",
        "srun_status=$status",
        f'if [ -s "${EXIT_STATUS_VAR}" ]; then',
        f'    status=$(cat "${EXIT_STATUS_VAR}")',
        '    [ "$status" = "$srun_status" ] || echo "gyre: exit $status, the controller\'s (srun: $srun_status, its worst task)"',
        "fi",
    ]


def _requeue_lines(cluster: ClusterConfig) -> list[str]:
    if not cluster.requeue:
        return []
    return [
        f'if [ "$status" -eq {PREEMPTED_EXIT_CODE} ] && [ "$stop_requested" = 1 ]; then',
        "    # checkpointed on a stop signal: back to the queue; the same command resumes from output_dir",
        '    echo "gyre: stopped with a checkpoint; requeueing job ${SLURM_JOB_ID}"',
        '    scontrol requeue "$SLURM_JOB_ID" || echo "gyre: requeue refused (already requeued by Slurm?)" >&2',
        "fi",
    ]


def _task_wrapper(step: Step, layout: ScriptLayout) -> list[str]:
    """`bash -c 'exec "$@" >>LOG' task`: each task opens its own log, named by its SLURM_PROCID."""
    out, err = layout.log_names(step)
    for name in (out, err or ""):
        if "'" in name or '"' in name:
            raise ValueError(f"log name {name!r} must not contain quotes")
    redirect = f'>>"$GYRE_LOG_DIR/{out}" ' + (f'2>>"$GYRE_LOG_DIR/{err}"' if err else "2>&1")
    return ["bash", "-c", f'exec "$@" {redirect}', "task"]


def rank_argv(step: Step) -> list[str]:
    """What each task runs: the step's command (its argv[0] the cluster's Python), behind the PMI-1 relay unless
    the step speaks PMIx (gyre/sched/launch/pmi_relay.py: Slurm's PMI-1 server reads 1,024 bytes a request)."""
    if step.mpi.startswith("pmix"):
        return list(step.argv)
    return [step.argv[0], "-m", PMI_RELAY_MODULE, "--", *step.argv]


def _srun_lines(step: Step, layout: ScriptLayout) -> list[str]:
    """One srun over every component (`srun A : B : C`): a single MPI_COMM_WORLD across the het job."""
    mpi = [f"--mpi={step.mpi}"] if step.mpi else []
    # the relay makes MPICH's name for the world this start's own: its shared memory never meets a dead world's
    lines = [] if step.mpi.startswith("pmix") else [f'export {WORLD_NONCE_VAR}="$(date +%s%N)"']
    for i, comp in enumerate(step.components):
        # a task that fails does not end the others: the controller decides whether the run goes on without it
        keep = ["--kill-on-bad-exit=0"]
        srun = [
            *(["srun"] if i == 0 else [":"]),
            f"--het-group={comp.group}",
            "--overlap",
            *keep,
            *mpi,
            *comp.srun_args,
        ]
        lines += [("" if i == 0 else "    ") + f"{shlex.join(srun)} \\"]
        lines += [f"    {shlex.join(_task_wrapper(step, layout))} \\"]
        lines.append(f"    {shlex.join(rank_argv(step))}" + (" \\" if i + 1 < len(step.components) else " &"))
    return lines


def render_sbatch(cfg: RunConfig, step: Step, layout: ScriptLayout) -> str:
    cluster = cfg.cluster
    all_cells = cells(cfg)
    lines = [
        "#!/bin/bash",
        f"# Generated by gyre (launch/slurm): one heterogeneous job of {len(all_cells)} cells, component 0 the",
        f"# core cell, components 1..{len(all_cells) - 1} the satellite cells. Submit with `sbatch <this file>`.",
        f"# Resolved config: {layout.config_path}",
        f"#SBATCH --job-name={shlex.quote(cluster.job_name)}",
        f"#SBATCH --output={shlex.quote(layout.log_dir + '/' + layout.batch_output)}",
    ]
    if layout.batch_error:
        lines.append(f"#SBATCH --error={shlex.quote(layout.log_dir + '/' + layout.batch_error)}")
    lines += ["#SBATCH --open-mode=append", f"#SBATCH --export={shlex.quote(cluster.export)}"]
    lines += _requeue_header(cluster)
    for cell, res in enumerate(all_cells):
        if cell:
            lines.append("#SBATCH hetjob")
        lines += _component_header(cfg, res, component_layout(cell, res))
    lines += ["", "set -euo pipefail"]
    if cluster.workdir:
        lines.append(f"cd {shlex.quote(cluster.workdir)}")
    lines += cluster.setup
    lines.append(f"export GYRE_LOG_DIR={shlex.quote(layout.log_dir)}")
    # Slurm's per-component task counts describe the allocation; the step's own tell each rank its cell
    env = [(HET_TASKS_VAR, ",".join(str(c.tasks) for c in step.components)), *CELL_JOB_ENV]
    env += [("OMP_NUM_THREADS", str(cfg.sched.threads_per_cell)), *layout.exports]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in env]
    lines.append(f'export {EXIT_STATUS_VAR}="$GYRE_LOG_DIR/${{SLURM_JOB_ID}}_${{SLURM_RESTART_COUNT:-0}}.exit_status"')
    # srun ends the step on SIGTERM but forwards SIGUSR2 to every rank: the controller checkpoints, exits 75
    lines += ["", "job=", *_start_lines("$job", "as SIGUSR2, which srun forwards to the ranks", "USR2"), ""]
    lines += [
        f"# The cell job: {step.num_tasks} ranks, one MPI world over every component. Rank 0 (the controller) and",
        "# the core cell's ranks on component 0, satellite i's on component i; each cell's first rank starts its",
        "# engine, and all its ranks hold its Megatron replica (tensor/pipeline shards when it has several).",
        *_engine_lines(cfg),
        *_leftover_lines(cfg, step),
        "set +e",
    ]
    lines += (
        _guarded_start_lines(step, layout, cluster)
        if layout.start_guard
        else [f'rm -f "${EXIT_STATUS_VAR}"', *_srun_lines(step, layout), "job=$!"]
    )
    lines += [*_wait_lines("$job"), *_controller_status_lines(), '[ "$srun_status" -eq 0 ] || remove_mpich_leftovers']
    lines += [*_requeue_lines(cluster), 'exit "$status"', ""]
    return "\n".join(lines)


def _leftover_lines(cfg: RunConfig, step: Step) -> list[str]:
    """`remove_mpich_leftovers`: one task on each node of the job runs gyre.sched.launch.mpich_leftovers, which
    removes what MPICH left there since the job's first start and no process holds. Run after a start that failed:
    a world that ends without MPI_Finalize leaves its shared memory on every node until the node restarts, and
    Slurm kills a failed step's tasks (all of them on MPI_Abort), so nothing inside the step can clean up."""
    all_cells = cells(cfg)
    lines = [
        "# MPICH leaves its ranks' shared memory (/dev/shm/mpich_shm_*) on each node when a world ends without",
        "# MPI_Finalize (an abort, a kill): after a start that failed, remove what no process holds on every node",
        "mpich_since=$(date +%s)",
        "remove_mpich_leftovers() {",
    ]
    for i, comp in enumerate(step.components):
        nodes = all_cells[comp.group].nodes
        srun = ["timeout", "60", "srun"] if i == 0 else [":"]
        srun += [f"--het-group={comp.group}", "--overlap", "--mpi=none", f"--nodes={nodes}", f"--ntasks={nodes}"]
        srun += ["--ntasks-per-node=1", "--cpus-per-task=1"]
        lines.append(("    " if i == 0 else "        ") + f"{shlex.join(srun)} \\")
        last = i + 1 == len(step.components)
        command = f'{shlex.join([step.argv[0], "-m", LEFTOVERS_MODULE])} "$mpich_since"'
        lines.append(f"        {command}" + (" \\" if not last else ""))
    lines[-1] += ' \\\n        || echo "gyre: what MPICH left on the nodes was not removed (exit $?)" >&2'
    return [*lines, "}"]


def _engine_lines(cfg: RunConfig) -> list[str]:
    """What each cell's first rank starts when the engine is SGLang (gyre.engine.sglang_backend.plan_servers, the
    same call), as comments: <...> are what the run knows only then (hosts, weights, its key file)."""
    if cfg.engine.backend != "sglang":
        return []
    from gyre.engine.sglang_backend import launch_command, plan_servers

    lines = ["# Its SGLang servers, per cell (started by the cell's first rank, on the other nodes through srun):"]
    for i, res in enumerate(cells(cfg)):
        nodes = [f"<cell{i}-node{j}>" for j in range(res.nodes)]
        plan = plan_servers("<weights>", cfg.engine, cfg.model, nodes, res.gpus_per_node, weight_version="<version>",
                            routed_experts=cfg.rl.routing_replay, key_file="<log dir>/engine-admin-key.yaml")  # fmt: skip
        for launch in plan:
            cmd = launch_command(cfg.engine, launch, local_node=nodes[0])
            lines.append(f"#   cell {i} on {launch.node}: {shlex.join(cmd)}")
    return lines


def _guarded_start_lines(step: Step, layout: ScriptLayout, cluster: ClusterConfig) -> list[str]:
    """Start the step; if the MPI world is not up within cluster.mpi_start_timeout_s (rank 0 creates
    $GYRE_WORLD_UP_FILE once every rank has joined), end the step and start it again, at most
    cluster.mpi_start_attempts times: a rank stuck in MPI_Init, a node that never starts its task (the cause seen
    most, PMI-1 requests longer than Slurm reads, is gone: rank_argv); a start that got past it is never rerun here
    (resume handles everything later)."""
    timeout, attempts = cluster.mpi_start_timeout_s, cluster.mpi_start_attempts
    up = f'"${WORLD_UP_VAR}"'
    body = [
        "attempt=$((attempt + 1))",
        f"export {START_ATTEMPT_VAR}=$attempt",
        f'export {WORLD_UP_VAR}="$GYRE_LOG_DIR/${{SLURM_JOB_ID}}_${{SLURM_RESTART_COUNT:-0}}_$attempt.world_up"',
        f'rm -f "${EXIT_STATUS_VAR}"',
        *_srun_lines(step, layout),
        "job=$!",
        "waited=0",
        f'while [ ! -e {up} ] && [ "$stop_requested" = 0 ] && [ "$waited" -lt {timeout} ] && kill -0 "$job" 2>/dev/null; do',
        "    sleep 1; waited=$((waited + 1))",
        "done",
        f'if [ -e {up} ] || [ "$stop_requested" = 1 ]; then rm -f {up}; break; fi',
        f'echo "gyre: the MPI world did not come up (start $attempt of {attempts}, ${{waited}} s); ending the step" >&2',
        'kill -TERM "$job" 2>/dev/null',
        'for _ in $(seq 10); do kill -0 "$job" 2>/dev/null || break; sleep 1; done',
        'kill -KILL "$job" 2>/dev/null; wait "$job"',
        "remove_mpich_leftovers",
        f'if [ "$attempt" -ge {attempts} ]; then',
        f'    echo "gyre: no MPI world after {attempts} starts; see the ranks\' logs in $GYRE_LOG_DIR" >&2',
        "    exit 1",
        "fi",
        *[f"rm -f {pattern}" for pattern in layout.stale_on_restart],
    ]
    return ["attempt=0", "while :; do", *["    " + line for line in body], "done"]


def render_main_job_sbatch(cfg: RunConfig, argv: list[str], log_dir: str) -> str:
    """A one-component job running `argv` (the colocate main job, `python -m launch.run ... output_dir=...`)
    on the core cell's resources, in the batch step. Requeued, the same argv resumes from its output_dir."""
    cluster = cfg.cluster
    lines = [
        "#!/bin/bash",
        "# Generated by gyre (launch/slurm): the main job as one Slurm job. Submit with `sbatch <this file>`;",
        "# on requeue (preemption, time limit, `scontrol requeue`) it resumes from its output_dir.",
        f"#SBATCH --job-name={shlex.quote(cluster.job_name)}",
        f"#SBATCH --output={shlex.quote(log_dir + '/%j_main.out')}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --export={shlex.quote(cluster.export)}",
        *_requeue_header(cluster),
        *_component_header(cfg, cluster.core),
        "",
        "set -euo pipefail",
    ]
    if cluster.workdir:
        lines.append(f"cd {shlex.quote(cluster.workdir)}")
    lines += cluster.setup
    lines += ["", "main=", *_start_lines("$main"), "", f"{shlex.join(argv)} &", "main=$!", *_wait_lines("$main")]
    lines += [*_requeue_lines(cluster), 'exit "$status"', ""]
    return "\n".join(lines)


def render_eval_sbatch(cfg: RunConfig, argv: list[str], log_dir: str) -> str:
    """One evaluation (`python -m launch.eval ... output_dir=...`: one local cell in one process) as a one-node
    job on the core cell's resources. Not requeued: an eval keeps no checkpoint of its own, so one that was
    interrupted is submitted again (into a fresh output_dir)."""
    cluster = cfg.cluster
    lines = [
        "#!/bin/bash",
        "# Generated by gyre (launch.submit --eval): one evaluation as one Slurm job. Submit with `sbatch <this file>`;",
        "# it is not requeued (an eval keeps no checkpoint): submit it again if it was interrupted.",
        f"#SBATCH --job-name={shlex.quote(cluster.job_name + '-eval')}",
        f"#SBATCH --output={shlex.quote(log_dir + '/%j_eval.out')}",
        f"#SBATCH --export={shlex.quote(cluster.export)}",
        *_component_header(cfg, cluster.core),
        "",
        "set -euo pipefail",
    ]
    if cluster.workdir:
        lines.append(f"cd {shlex.quote(cluster.workdir)}")
    lines += cluster.setup
    lines += [
        "",
        'echo "gyre: eval job ${SLURM_JOB_ID} on $(hostname) at $(date +%FT%T)"',
        f"exec {shlex.join(argv)}",
        "",
    ]
    return "\n".join(lines)
