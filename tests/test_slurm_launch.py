"""The Slurm adapter without a cluster: golden sbatch text, layouts, preflight checks on parsed inventories."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gyre.config.domain import ConfigValueError
from gyre.config.load import compose
from gyre.config.schema import CellResources, RunConfig
from gyre.config.validate import check_cells
from launch.slurm.launchers import eval_argv, plain_script
from launch.slurm.plan import LayoutError, cells, component_layout, job_command, plan_step
from launch.slurm.preflight import (
    SlurmPreflightError,
    check_addresses,
    check_request,
    parse_inventory,
    parse_mem_mb,
    parse_time_s,
    require_slurm,
)
from launch.slurm.sbatch import render_eval_sbatch
from launch.submit import main as submit_main

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def gpu_cfg() -> RunConfig:
    return compose(["cluster=slurm_gpu"])


@pytest.fixture(scope="module")
def three_node_cfg(gpu_cfg) -> RunConfig:
    """Three cells of one 8-GPU node each (one rank), for the preflight checks of a request against an inventory."""
    cfg = copy.deepcopy(gpu_cfg)
    node = CellResources(nodes=1, tasks_per_node=1, cpus_per_node=96, gpus_per_node=8, mem="0", partition="gpu",
                         time="2-00:00:00")  # fmt: skip
    cfg.cluster.core, cfg.cluster.satellites = node, [copy.deepcopy(node), copy.deepcopy(node)]
    cfg.train.tensor_parallel = cfg.train.pipeline_parallel = 1
    cfg.engine.tp_size, cfg.engine.pp_size = 8, 1
    return cfg


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("GYRE_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing {path}; create it with GYRE_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} changed; if intended, regenerate with GYRE_UPDATE_GOLDEN=1"


@pytest.mark.parametrize(
    "preset", ["slurm_cpu", "slurm_cpu_tp2", "slurm_cpu_tp2_nodes", "slurm_gpu", "slurm_gpu_small"]
)
def test_generated_sbatch_matches_golden(preset):
    # slurm_cpu runs the submitting interpreter by absolute path: fixed here, as if submitted from /shared/gyre
    python = ["cluster.python=/shared/gyre/.venv/bin/python"] if preset.startswith("slurm_cpu") else []
    cfg = compose([f"cluster={preset}", "cluster.workdir=/shared/gyre", *python])
    _golden(f"{preset}.sbatch", plain_script(cfg, "/shared/runs/r1/config.yaml", "/shared/runs/r1/slurm"))


def test_the_cell_job_is_one_mpi_world_over_every_component(gpu_cfg):
    step = plan_step(gpu_cfg, job_command(gpu_cfg, "/runs/r1"))
    assert step.argv == ("python", "-m", "mpi4py", "-m", "gyre.sched.launch.job", "/runs/r1") and step.mpi == "pmix"
    # 2 cells of 2 nodes x 8 ranks (one per GPU); component 0 holds the controller beside the core's 16
    assert step.het_groups == (0, 1) and [c.tasks for c in step.components] == [17, 16]
    assert "--gres=gpu:8" in step.components[1].srun_args and "--ntasks-per-node=8" in step.components[1].srun_args
    assert "--nodes=2" in step.components[0].srun_args and "--cpus-per-task=10" in step.components[0].srun_args
    script = plain_script(gpu_cfg, "/runs/r1/config.yaml", "/runs/r1/slurm")
    cell_step = [line.split()[:2] for line in script.splitlines() if "--mpi=pmix" in line]
    assert cell_step == [["srun", "--het-group=0"], [":", "--het-group=1"]] and "GYRE_HET_TASKS=17,16" in script
    # after a failed start, a task on each of the job's nodes removes what MPICH left there
    cleanup = [line.split()[:4] for line in script.splitlines() if "--mpi=none" in line]
    assert cleanup == [["timeout", "60", "srun", "--het-group=0"], [":", "--het-group=1", "--overlap", "--mpi=none"]]
    assert "--het-group=0 --overlap --mpi=none --nodes=2 --ntasks=2 --ntasks-per-node=1" in script


def test_cells_of_several_ranks_lay_out_their_tasks_on_their_nodes():
    cfg = compose(["cluster=slurm_cpu_tp2"])
    step = plan_step(cfg, job_command(cfg, "/runs/r1"))
    assert [c.tasks for c in step.components] == [3, 2]  # the controller and the core's 2 ranks, the satellite's 2
    assert step.components[0].srun_args == (
        "--ntasks=3", "--nodes=1", "--ntasks-per-node=3", "--cpus-per-task=1", "--distribution=block"
    )  # fmt: skip
    # a core of 2 nodes x 1 task: 2 tasks on its first node (the controller beside rank 0), 1 on the second
    cfg = compose(["cluster=slurm_cpu_tp2_nodes"])
    step = plan_step(cfg, job_command(cfg, "/runs/r1"))
    assert [c.tasks for c in step.components] == [3, 2]
    assert step.components[0].srun_args == ("--nodes=2", "--ntasks=3", "--cpus-per-task=1", "--distribution=block")
    assert component_layout(0, cfg.cluster.core).tasks_per_node == 2


def test_layouts_the_cell_runtime_cannot_hold_fail_with_the_key_to_change(gpu_cfg):
    cfg = copy.deepcopy(gpu_cfg)
    cfg.engine.pp_size = 1
    with pytest.raises(
        LayoutError, match="engine.tp_size=8: with engine.pp_size=1 holds 8 GPUs, but cell 0 has 2 node"
    ):
        plan_step(cfg, ["x"])
    with pytest.raises(ConfigValueError, match="engine.pp_size=2: needs engine.weight_sync=disk .*resolves to tensor"):
        compose(["cluster=slurm_gpu_small", "engine.tp_size=4", "engine.pp_size=2"])  # 8 GPUs, but CUDA IPC
    cfg = copy.deepcopy(gpu_cfg)
    cfg.train.pipeline_parallel = 4
    with pytest.raises(LayoutError, match=r"cluster.core.tasks_per_node=8: cell 0 has 2 node\(s\) x 8 task.*= 32 rank"):
        plan_step(cfg, ["x"])
    cfg = copy.deepcopy(gpu_cfg)
    cfg.cluster.satellites[0].tasks_per_node = 2
    with pytest.raises(LayoutError, match="cluster.satellites.0.tasks_per_node=2: cell 1 has"):
        plan_step(cfg, ["x"])
    cfg = copy.deepcopy(gpu_cfg)
    cfg.cluster.satellites[0].nodes = 1  # 8 ranks for a 16-rank trainer
    with pytest.raises(LayoutError, match=r"cluster.satellites.0.tasks_per_node=8: cell 1 has 1 node\(s\) x 8"):
        plan_step(cfg, ["x"])
    cfg = copy.deepcopy(gpu_cfg)
    cfg.engine.backend, cfg.cluster.satellites[0].gpus_per_node = "embedded", 4
    with pytest.raises(LayoutError, match="cluster.satellites.0.tasks_per_node=8 exceeds .*gpus_per_node=4"):
        plan_step(cfg, ["x"])
    plan_step(gpu_cfg, ["x"])  # TP 8 x PP 2 over each cell's 2 nodes x 8 GPUs: NCCL inside a multi-rank cell
    cfg = compose(["cluster=slurm_cpu_tp2_nodes", "cluster.core.cpus_per_node=1"])  # controller + rank 0 on node 1
    with pytest.raises(LayoutError, match="cluster.core.cpus_per_node=1: .*set cluster.core.cpus_per_node to 2"):
        plan_step(cfg, ["x"])
    cfg = compose(["cluster=slurm_cpu_tp2_nodes", "train.tensor_parallel=1", "train.pipeline_parallel=2"])
    plan_step(cfg, ["x"])  # PP 2 over the same two nodes runs
    cfg = compose(["cluster=slurm_cpu_tp2_nodes", "train.tensor_parallel=4"])
    with pytest.raises(LayoutError, match=r"cluster.core.tasks_per_node=1: cell 0 has 2 node\(s\) x 1 task.*= 4 rank"):
        plan_step(cfg, ["x"])


@pytest.mark.parametrize("preset", [p.stem for p in (ROOT / "conf" / "cluster").glob("*.yaml")])
def test_every_cluster_preset_is_a_layout_the_code_runs(preset):
    cfg = compose([f"cluster={preset}"])
    check_cells(cfg)
    if cfg.cluster.backend == "slurm":
        plan_step(cfg, job_command(cfg, "/runs/r1"))


def test_slurm_time_and_memory_syntax():
    assert parse_time_s("30") == 1800 and parse_time_s("01:30") == 90 and parse_time_s("02:00:00") == 7200
    assert parse_time_s("2-00:00:00") == 172800 and parse_time_s("1-12") == 129600 and parse_time_s("UNLIMITED") is None
    assert parse_mem_mb("4000") == 4000 and parse_mem_mb("16G") == 16384 and parse_mem_mb("1T") == 1048576
    with pytest.raises(SlurmPreflightError, match="16G"):
        parse_mem_mb("lots")


PARTITIONS = """\
PartitionName=gpu AllowGroups=ALL Default=NO MaxNodes=4 MaxTime=2-00:00:00 State=UP TotalNodes=3
PartitionName=cpu AllowGroups=ALL Default=YES MaxNodes=UNLIMITED MaxTime=UNLIMITED State=UP TotalNodes=1
"""
NODES = """\
NodeName=g1 CPUTot=96 RealMemory=1000000 Gres=gpu:h100:8(S:0-1) State=IDLE Partitions=gpu OS=Linux 6.1 #1 SMP
NodeName=g2 CPUTot=96 RealMemory=1000000 Gres=gpu:8 State=MIXED Partitions=gpu
NodeName=g3 CPUTot=96 RealMemory=1000000 Gres=gpu:8 State=IDLE+DRAIN Partitions=gpu
NodeName=c1 CPUTot=4 RealMemory=4000 Gres=(null) State=IDLE Partitions=cpu
"""


def _cells(cfg: RunConfig, **changes: object) -> list[CellResources]:
    """The cells of a copy of cfg with `changes` ("core__nodes"-style keys) applied."""
    result = copy.deepcopy(cells(cfg))
    for key, value in changes.items():
        cell, name = key.split("__")
        setattr(result[0 if cell == "core" else int(cell[3:])], name, value)  # sat1 = cells[1]
    return result


def test_inventory_parsing():
    inv = parse_inventory(PARTITIONS, NODES)
    assert inv.partitions["gpu"].max_time_s == 172800 and inv.partitions["gpu"].max_nodes == 4
    assert inv.partitions["cpu"].max_time_s is None and inv.partitions["cpu"].max_nodes is None
    assert [(n.name, n.gpus) for n in inv.nodes_of("gpu")] == [("g1", 8), ("g2", 8)]  # g3 is draining


def test_preflight_names_what_to_change(three_node_cfg):
    inv = parse_inventory(PARTITIONS, NODES)
    check_request(_cells(three_node_cfg)[:2], inv)
    with pytest.raises(SlurmPreflightError, match="cluster.satellites.1.partition='gpux'.*it has: cpu, gpu"):
        check_request(_cells(three_node_cfg, sat2__partition="gpux"), inv)
    with pytest.raises(SlurmPreflightError, match="cluster.core asks for 1 node.*has 0 such node.*largest node has 96"):
        check_request(_cells(three_node_cfg, core__cpus_per_node=128), inv)
    with pytest.raises(SlurmPreflightError, match="exceeds the MaxTime"):
        check_request(_cells(three_node_cfg, core__time="3-00:00:00"), inv)
    with pytest.raises(SlurmPreflightError, match="needs 3 distinct nodes.*only 2 nodes fit"):
        check_request(_cells(three_node_cfg), inv)


def test_het_job_on_a_single_node_cluster_is_refused_before_submitting(three_node_cfg):
    inv = parse_inventory(PARTITIONS, NODES)
    small = {"nodes": 1, "cpus_per_node": 2, "gpus_per_node": 0, "mem": "", "partition": "cpu"}
    changes = {f"{cell}__{k}": v for cell in ("core", "sat1", "sat2") for k, v in small.items()}
    with pytest.raises(SlurmPreflightError, match=r"3 cells needs 3 distinct nodes.*single node \(c1\).*cluster=local"):
        check_request(_cells(three_node_cfg, **changes), inv)


def test_loopback_addresses_are_refused_before_submitting_to_separate_hosts(three_node_cfg):
    inv = parse_inventory(PARTITIONS, NODES)  # no NodeAddr: each node at its own name
    check_addresses("auto", "0.0.0.0", _cells(three_node_cfg)[:2], inv)
    with pytest.raises(SlurmPreflightError, match=r"separate hosts.*comm.hostname='127.0.0.1': set comm.hostname=auto"):
        check_addresses("127.0.0.1", "0.0.0.0", _cells(three_node_cfg)[:2], inv)
    with pytest.raises(SlurmPreflightError, match=r"engine.host='127.0.0.1': set engine.host=0.0.0.0"):
        check_addresses("auto", "127.0.0.1", _cells(three_node_cfg)[:2], inv)
    one_host = parse_inventory(PARTITIONS, "".join(f"{line} NodeAddr=127.0.0.1\n" for line in NODES.splitlines()))
    check_addresses("127.0.0.1", "127.0.0.1", _cells(three_node_cfg)[:2], one_host)  # the loopback test cluster


def test_no_slurm_on_path():
    with pytest.raises(SlurmPreflightError, match="no Slurm on the PATH.*cluster=local.*slurm/cluster.sh start"):
        require_slurm({"PATH": "/nonexistent"})


def test_dry_run_writes_script_and_resolved_config(tmp_path, capsys):
    submit_main(["--dry-run", "--out", str(tmp_path), "cluster=slurm_gpu", "seed=7"])
    assert "wrote" in capsys.readouterr().out
    script = (tmp_path / "gyre.sbatch").read_text()
    assert script.count("#SBATCH hetjob") == 1 and f"gyre.sched.launch.job {tmp_path} " in script
    saved = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(tmp_path / "config.yaml"))
    resolved = OmegaConf.to_object(saved)
    assert resolved.seed == 7 and resolved.cluster.mooncake.protocol == "rdma" and resolved.output_dir == str(tmp_path)
    assert (tmp_path / "slurm").is_dir()
    with pytest.raises(SystemExit, match="engine.tp_size=16: with engine.pp_size=2 holds 32 GPUs, but cell 0 has 2"):
        submit_main(["--dry-run", "--out", str(tmp_path), "cluster=slurm_gpu", "engine.tp_size=16"])
    with pytest.raises(SystemExit, match="scheduler='colocate' runs on one machine.*scheduler=colocate_cells"):
        submit_main(["--dry-run", "--out", str(tmp_path), "cluster=slurm_gpu", "scheduler=colocate"])


def test_eval_sbatch_matches_golden():
    """`launch.submit --eval`: launch.eval with the submitted overrides (its own output_dir) on one node."""
    cfg = compose(["cluster=slurm_cpu", "cluster.workdir=/shared/gyre", "cluster.python=/shared/gyre/.venv/bin/python"])
    overrides = ["cluster=slurm_cpu", "eval.checkpoint=/shared/runs/r1/checkpoint", "eval.samples=4", "output_dir=/x"]
    argv = eval_argv(cfg, overrides, Path("/shared/runs/r1-eval"))
    _golden("eval_job.sbatch", render_eval_sbatch(cfg, argv, "/shared/runs/r1-eval/slurm"))


def test_dry_run_of_an_eval_writes_a_one_node_script(tmp_path, capsys):
    submit_main(
        ["--eval", "--dry-run", "--out", str(tmp_path), "cluster=slurm_cpu", "eval.checkpoint=/runs/r1/checkpoint"]
    )
    assert "gyre-eval.sbatch" in capsys.readouterr().out
    script = (tmp_path / "gyre-eval.sbatch").read_text()
    assert f" -m launch.eval cluster=slurm_cpu eval.checkpoint=/runs/r1/checkpoint output_dir={tmp_path} " in script
    assert script.startswith("#!/bin/bash") and "--nodes=1" in script and "--ntasks-per-node=1" in script
    assert "hetjob" not in script and "--requeue" not in script and "srun" not in script
    assert subprocess.run(["bash", "-n", str(tmp_path / "gyre-eval.sbatch")]).returncode == 0
    assert OmegaConf.load(tmp_path / "config.yaml").eval.checkpoint == "/runs/r1/checkpoint"
    with pytest.raises(SystemExit, match="drop --via submitit"):
        submit_main(["--eval", "--via", "submitit", "--dry-run", "--out", str(tmp_path), "cluster=slurm_cpu"])


def test_submit_without_slurm_on_path_fails_with_a_hint(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launch.submit", "--out", str(tmp_path), "cluster=slurm_cpu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/nonexistent", "HOME": str(tmp_path)},
    )
    assert proc.returncode != 0 and "no Slurm on the PATH" in proc.stderr and "Traceback" not in proc.stderr


def test_engines_bound_to_every_interface_are_advertised_at_the_node_address(gpu_cfg):
    from gyre.sched.cell.worker import advertised_url

    assert gpu_cfg.engine.host == "0.0.0.0" and gpu_cfg.comm.hostname == "auto"
    assert advertised_url("http://0.0.0.0:30000", "10.1.2.3") == "http://10.1.2.3:30000"
    assert advertised_url("http://127.0.0.1:30000", "10.1.2.3") == "http://127.0.0.1:30000"  # one machine: as is


def test_every_launcher_renders_what_it_would_start(tmp_path, gpu_cfg, three_node_cfg):
    """One interface over mpirun, this process, sbatch and submitit, chosen in launch.launchers: the dry run of each
    is the command or script its launch would start."""
    from gyre.sched.launch.launcher import LaunchPlan
    from gyre.sched.launch.local import InProcessLauncher, MpirunLauncher, local_plan
    from launch.launchers import Via, launcher_for
    from launch.slurm.launchers import SbatchLauncher, SubmititLauncher

    plan = LaunchPlan(gpu_cfg, tmp_path, tmp_path / "config.yaml", tmp_path / "slurm")
    sbatch, submitit = launcher_for(gpu_cfg, Via.sbatch), launcher_for(gpu_cfg, Via.submitit)
    assert isinstance(sbatch, SbatchLauncher) and isinstance(submitit, SubmititLauncher)
    assert sbatch.render(plan) == plain_script(gpu_cfg, str(plan.config_path), str(plan.log_dir))
    het = submitit.render(plan)
    assert het.count("#SBATCH hetjob") == 1 and "-m submitit.core._submit" in het and "_result.pkl" in het
    local = [copy.deepcopy(three_node_cfg) for _ in range(2)]  # cells of one rank: colocate runs in-process
    for cfg, scheduler in zip(local, ("colocate", "elastic"), strict=True):
        cfg.scheduler, cfg.output_dir = scheduler, str(tmp_path / scheduler)
    plans = [local_plan(cfg) for cfg in local]  # the run directory and its config.yaml
    assert [type(launcher_for(cfg, Via.local)) for cfg in local] == [InProcessLauncher, MpirunLauncher]
    mpirun = launcher_for(local[1], Via.local).render(plans[1])
    assert " -disable-auto-cleanup -n " in mpirun and mpirun.endswith(f"{sys.executable} {tmp_path / 'elastic'}")
