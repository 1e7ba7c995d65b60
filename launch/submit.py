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
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from gyre.config.load import check_overrides, compose
from gyre.config.schema import CELL_SCHEDULERS, RunConfig
from gyre.errors import reported, take_verbose_flag
from gyre.sched.launch.local import POLICY_FILE, RANK_ERROR_FILE
from launch.slurm.plan import cells, cluster_python, job_command, plan_step
from launch.slurm.preflight import SlurmPreflightError, check_addresses, check_request, read_inventory
from launch.slurm.sbatch import ScriptLayout, render_eval_sbatch, render_sbatch


def plain_script(cfg: RunConfig, config_path: str, log_dir: str) -> str:
    """The sbatch script a user can submit with `sbatch`: the cell job over every component."""
    step = plan_step(cfg, job_command(cfg, str(Path(config_path).parent)))
    return render_sbatch(cfg, step, ScriptLayout(log_dir=log_dir, config_path=config_path, start_guard=True))


def run_cell_job(run_dir: str) -> dict[str, Any]:
    """What each task runs under submitit (imported there: importing MPI here would initialise it)."""
    from gyre.sched.launch.job import submitit_main

    return submitit_main(run_dir)


def write_job_files(cfg: RunConfig, out_dir: Path) -> tuple[Path, Path, Path]:
    """Resolved config, log folder and plain sbatch script under out_dir (absolute paths)."""
    out_dir = out_dir.resolve()
    cfg.output_dir = str(out_dir)
    log_dir = Path(cfg.cluster.log_dir).resolve() if cfg.cluster.log_dir else out_dir / "slurm"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.yaml"
    config_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    (out_dir / POLICY_FILE).unlink(missing_ok=True)  # rank 0 writes it anew; the cells wait for it
    (out_dir / RANK_ERROR_FILE).unlink(missing_ok=True)  # an earlier job's failure is not this one's
    script_path = out_dir / "gyre.sbatch"
    script_path.write_text(plain_script(cfg, str(config_path), str(log_dir)))
    return config_path, log_dir, script_path


def check_slurm_backend(cfg: RunConfig) -> None:
    if cfg.cluster.backend != "slurm":
        raise SlurmPreflightError(
            f"cluster.backend is {cfg.cluster.backend!r}: choose a Slurm cluster config, e.g. cluster=slurm_cpu"
        )


def sbatch(script_path: Path) -> str:
    proc = subprocess.run(["sbatch", "--parsable", str(script_path)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise SlurmPreflightError(f"sbatch refused the job: {proc.stderr.strip()}")
    return proc.stdout.strip().split(";")[0]


def eval_argv(cfg: RunConfig, overrides: list[str], out_dir: Path) -> list[str]:
    """The node's command: launch.eval with the submitted overrides, its output in out_dir."""
    own = ("output_dir=", "hydra.run.dir=")
    kept = [o for o in overrides if not o.lstrip("+~").startswith(own)]
    return [
        cluster_python(cfg),
        "-m",
        "launch.eval",
        *kept,
        f"output_dir={out_dir}",
        f"hydra.run.dir={out_dir / 'hydra'}",
    ]


def submit_eval(cfg: RunConfig, overrides: list[str], out_dir: Path, dry_run: bool) -> str:
    """launch.eval as a one-node sbatch job (one local cell in one process, as on a workstation)."""
    check_slurm_backend(cfg)
    cfg.cluster.python = cluster_python(cfg)
    out_dir = out_dir.resolve()
    cfg.output_dir = str(out_dir)
    log_dir = Path(cfg.cluster.log_dir).resolve() if cfg.cluster.log_dir else out_dir / "slurm"
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "config.yaml"  # for the record: the node composes the same overrides itself
    config_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    script_path = out_dir / "gyre-eval.sbatch"
    script_path.write_text(render_eval_sbatch(cfg, eval_argv(cfg, overrides, out_dir), str(log_dir)))
    print(f"gyre: wrote {script_path} and {config_path}")
    if dry_run:
        return ""
    check_request([cfg.cluster.core], read_inventory(os.environ))
    job_id = sbatch(script_path)
    print(f"gyre: submitted eval job {job_id}; log in {log_dir}, results in {out_dir}")
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
    config_path, log_dir, script_path = write_job_files(cfg, out_dir)
    print(f"gyre: wrote {script_path} and {config_path}")
    if dry_run:
        return ""
    inventory = read_inventory(os.environ)
    check_request(cells(cfg), inventory)
    check_addresses(cfg.comm.hostname, cfg.engine.host, cells(cfg), inventory)
    if via == "sbatch":
        job_id = sbatch(script_path)
    else:
        from launch.slurm.het_executor import HetSlurmExecutor

        executor = HetSlurmExecutor(log_dir, cfg, config_path=str(config_path), start_guard=True)
        job_id = executor.submit(run_cell_job, str(config_path.parent)).job_id
    print(f"gyre: submitted job {job_id}; logs in {log_dir}")
    return job_id


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.submit", description=__doc__.split("\n\n")[1])
    parser.add_argument("--dry-run", action="store_true", help="write the script and resolved config, submit nothing")
    parser.add_argument(
        "--via", choices=("submitit", "sbatch"), default=None, help="default: submitit (--eval: sbatch)"
    )
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
            if args.via == "submitit":
                raise SlurmPreflightError("--eval submits an sbatch script (gyre-eval.sbatch): drop --via submitit")
            submit_eval(cfg, args.overrides, out_dir, args.dry_run)
        else:
            submit(cfg, out_dir, args.via or "submitit", args.dry_run)


if __name__ == "__main__":
    main()
