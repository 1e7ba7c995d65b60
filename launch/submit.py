"""`python -m launch.submit [--dry-run] [--via submitit|sbatch] [--eval] cluster=slurm_cpu [key=value ...]`

Turns the config into one heterogeneous Slurm job (component 0 the core cell, 1..N the satellite
cells) running the cell job (scheduler=elastic|async|colocate_cells), and submits it through
submitit (job handle, logs and results in the log folder) or as a plain sbatch script. Always
writes `<out>/gyre.sbatch` and the resolved `<out>/config.yaml`; `--dry-run` stops there. Before
submitting, the request is checked against the cluster.

`--eval`: an evaluation instead (`python -m launch.eval` with the same overrides, e.g.
eval.checkpoint=<a run's checkpoint/>): a one-node job on the core cell's resources, written to
`<out>/gyre-eval.sbatch` and submitted with sbatch; its metrics row, table and shards land in <out>.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from gyre.config.load import check_overrides, compose
from gyre.config.schema import CELL_SCHEDULERS, RunConfig
from gyre.errors import reported, take_verbose_flag
from gyre.sched.launch.launcher import LaunchPlan
from gyre.sched.launch.local import POLICY_FILE, RANK_ERROR_FILE
from launch.launchers import SLURM_VIAS, Via, launcher_for
from launch.slurm.launchers import EVAL_SCRIPT, EvalSbatchLauncher, SbatchLauncher
from launch.slurm.plan import cells, cluster_python
from launch.slurm.preflight import SlurmPreflightError, check_addresses, check_request, read_inventory


def job_plan(cfg: RunConfig, out_dir: Path) -> LaunchPlan:
    """The resolved config and the log folder under out_dir (absolute paths)."""
    out_dir = out_dir.resolve()
    cfg.output_dir = str(out_dir)
    log_dir = Path(cfg.cluster.log_dir).resolve() if cfg.cluster.log_dir else out_dir / "slurm"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.yaml"
    config_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return LaunchPlan(cfg, out_dir, config_path, log_dir)


def write_job_files(cfg: RunConfig, out_dir: Path) -> LaunchPlan:
    """Resolved config, log folder and plain sbatch script under out_dir (absolute paths)."""
    plan = job_plan(cfg, out_dir)
    (plan.out / POLICY_FILE).unlink(missing_ok=True)  # rank 0 writes it anew; the cells wait for it
    (plan.out / RANK_ERROR_FILE).unlink(missing_ok=True)  # an earlier job's failure is not this one's
    (plan.out / "gyre.sbatch").write_text(SbatchLauncher().render(plan))
    return plan


def check_slurm_backend(cfg: RunConfig) -> None:
    if cfg.cluster.backend != "slurm":
        raise SlurmPreflightError(
            f"cluster.backend is {cfg.cluster.backend!r}: choose a Slurm cluster config, e.g. cluster=slurm_cpu"
        )


def submit_eval(cfg: RunConfig, overrides: list[str], out_dir: Path, dry_run: bool) -> str:
    """launch.eval as a one-node sbatch job (one local cell in one process, as on a workstation)."""
    check_slurm_backend(cfg)
    cfg.cluster.python = cluster_python(cfg)
    plan = job_plan(cfg, out_dir)  # config.yaml for the record: the node composes the same overrides itself
    launcher = EvalSbatchLauncher(overrides)
    (plan.out / EVAL_SCRIPT).write_text(launcher.render(plan))
    print(f"gyre: wrote {plan.out / EVAL_SCRIPT} and {plan.config_path}")
    if dry_run:
        return ""
    check_request([cfg.cluster.core], read_inventory(os.environ))
    job_id = str(launcher.launch(plan))
    print(f"gyre: submitted eval job {job_id}; log in {plan.log_dir}, results in {plan.out}")
    return job_id


def submit(cfg: RunConfig, out_dir: Path, via: str, dry_run: bool) -> str:
    check_slurm_backend(cfg)
    if cfg.scheduler not in CELL_SCHEDULERS:
        raise SlurmPreflightError(
            f"scheduler={cfg.scheduler!r} runs on one machine; a Slurm het job runs cells: choose "
            f"scheduler={'|'.join(CELL_SCHEDULERS)} (for the colocate loop on one node, sbatch the script of "
            "launch.slurm.sbatch.render_main_job_sbatch)"
        )
    cfg.cluster.python = cluster_python(cfg)  # the resolved config names the interpreter the nodes run
    plan = write_job_files(cfg, out_dir)
    print(f"gyre: wrote {plan.out / 'gyre.sbatch'} and {plan.config_path}")
    if dry_run:
        return ""
    inventory = read_inventory(os.environ)
    check_request(cells(cfg), inventory)
    check_addresses(cfg.comm.hostname, cfg.engine.host, cells(cfg), inventory)
    job_id = str(launcher_for(cfg, Via(via)).launch(plan))
    print(f"gyre: submitted job {job_id}; logs in {plan.log_dir}")
    return job_id


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.submit", description=__doc__.split("\n\n")[1])
    parser.add_argument("--dry-run", action="store_true", help="write the script and resolved config, submit nothing")
    vias = [str(v) for v in SLURM_VIAS]
    parser.add_argument("--via", choices=vias, default=None, help="default: submitit (--eval: sbatch)")
    parser.add_argument("--eval", action="store_true", help="evaluate (python -m launch.eval) instead of training")
    parser.add_argument(
        "--out", type=Path, default=None, help="job directory (default: output_dir or outputs/slurm/<time>)"
    )
    parser.add_argument("--verbose", action="store_true", help="show the traceback of an expected failure too")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. cluster=slurm_gpu steps=10")
    args = parser.parse_args(take_verbose_flag(list(sys.argv[1:] if argv is None else argv)))
    with reported():  # a refused value, layout or request: its one line, exit 1
        check_overrides(args.overrides)
        cfg = compose(args.overrides)
        stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
        out_dir = args.out or Path(cfg.output_dir or f"outputs/slurm/{stamp}")
        if args.eval:
            if args.via == Via.submitit:
                raise SlurmPreflightError(f"--eval submits an sbatch script ({EVAL_SCRIPT}): drop --via submitit")
            submit_eval(cfg, args.overrides, out_dir, args.dry_run)
        else:
            submit(cfg, out_dir, args.via or Via.submitit, args.dry_run)


if __name__ == "__main__":
    main()
