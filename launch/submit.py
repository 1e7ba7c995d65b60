"""`python -m launch.submit [--dry-run] [--via submitit|sbatch] cluster=slurm_cpu [key=value ...]`

Turns the config into one heterogeneous Slurm job (component 0 the core cell, 1..N the satellite
cells) running the cell job (scheduler=elastic|async|colocate_cells), and submits it through
submitit (job handle, logs and results in the log folder) or as a plain sbatch script. Always
writes `<out>/gyre.sbatch` and the resolved `<out>/config.yaml`; `--dry-run` stops there. Before
submitting, the request is checked against the cluster.
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
from launch.slurm.launchers import SbatchLauncher
from launch.slurm.plan import cells, cluster_python
from launch.slurm.preflight import SlurmPreflightError, check_addresses, check_request, read_inventory


def write_job_files(cfg: RunConfig, out_dir: Path) -> LaunchPlan:
    """Resolved config, log folder and plain sbatch script under out_dir (absolute paths)."""
    out_dir = out_dir.resolve()
    cfg.output_dir = str(out_dir)
    log_dir = Path(cfg.cluster.log_dir).resolve() if cfg.cluster.log_dir else out_dir / "slurm"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.yaml"
    config_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    (out_dir / POLICY_FILE).unlink(missing_ok=True)  # rank 0 writes it anew; the cells wait for it
    (out_dir / RANK_ERROR_FILE).unlink(missing_ok=True)  # an earlier job's failure is not this one's
    plan = LaunchPlan(cfg, out_dir, config_path, log_dir)
    (out_dir / "gyre.sbatch").write_text(SbatchLauncher().render(plan))
    return plan


def submit(cfg: RunConfig, out_dir: Path, via: str, dry_run: bool) -> str:
    if cfg.cluster.backend != "slurm":
        raise SlurmPreflightError(
            f"cluster.backend is {cfg.cluster.backend!r}: choose a Slurm cluster config, e.g. cluster=slurm_cpu"
        )
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
    parser.add_argument("--via", choices=[str(v) for v in SLURM_VIAS], default=str(Via.submitit))
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
        submit(cfg, out_dir, args.via, args.dry_run)


if __name__ == "__main__":
    main()
