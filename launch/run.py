"""`python -m launch.run [key=value ...]`: the main job (embedded default: local colocate run).

`scheduler=elastic|async|colocate_cells` runs the cells as an MPI job instead (gyre.sched).
The same output_dir again continues the run from its checkpoint (`resume=auto`, gyre/resume); a run
stopped by SIGTERM/SIGUSR1 checkpoints and exits with code 75.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gyre.config.load import ConfigKeyError, check_overrides, normalize_overrides, register_configs, to_run_config
from gyre.config.validate import ConfigValueError
from gyre.health import ExcludedRunError
from gyre.resume.preemption import PREEMPTED_EXIT_CODE, Preempted
from gyre.resume.recovery import ResumeError
from gyre.sched.policy import SCHEDULERS as CELL_SCHEDULERS

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    if not cfg.output_dir:
        cfg.output_dir = HydraConfig.get().runtime.output_dir
    if not cfg.tracking.run_name:  # one tracker run per Hydra (multirun) job, named by its overrides
        cfg.tracking.run_name = HydraConfig.get().job.override_dirname
    from gyre.tasks.source import preflight_suite

    try:  # a suite the run cannot use fails here with its causes, before anything starts
        report = preflight_suite(cfg.tasks)
    except ConfigValueError as e:
        sys.exit(f"gyre: {e}")
    if report:
        print(report, flush=True)
    if cfg.model.path:  # a model directory the run cannot start from fails here, before anything starts
        from gyre.model.pretrained import check_pretrained

        try:
            check_pretrained(cfg)
        except ConfigValueError as e:
            sys.exit(f"gyre: {e}")
    if cfg.scheduler in CELL_SCHEDULERS:  # cells as an MPI job: re-executes under mpirun
        from gyre.sched.launch import DEAD_CELLS_EXIT_CODE, DeadCellsError, run_cells

        try:
            run_cells(cfg)
        except Preempted:  # checkpointed; the same command (or the requeued job) resumes
            sys.exit(PREEMPTED_EXIT_CODE)
        except DeadCellsError as e:
            print(f"gyre: {e}", file=sys.stderr)
            sys.exit(DEAD_CELLS_EXIT_CODE)
        return
    from gyre.loop import run  # heavy imports (torch, megatron) only once the config is valid

    try:
        run(cfg)
    except Preempted:  # checkpointed; the generated sbatch script requeues the job on this exit code
        sys.exit(PREEMPTED_EXIT_CODE)
    except (ResumeError, ExcludedRunError, ConfigValueError) as e:
        sys.exit(f"gyre: {e}")


def run_app(app: Callable[[], object]) -> None:
    """Check the command line's overrides (a mistyped key names the valid ones), then run the Hydra app."""
    sys.argv[1:] = normalize_overrides(sys.argv[1:])
    try:
        check_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
    except ConfigKeyError as e:
        sys.exit(f"gyre: {e}")
    app()


if __name__ == "__main__":
    run_app(main)
