"""`python -m launch.run [--verbose] [key=value ...]`: the main job (embedded default: local colocate run).

Every scheduler runs the one controller (gyre.sched.controller.orchestrator): `scheduler=colocate` on one cell in this
process, `scheduler=elastic|async|colocate_cells` (or colocate over several cells) as an MPI job of cells.
The same output_dir again continues the run from its checkpoint (`resume=auto`, gyre/resume); a run
stopped by SIGTERM/SIGUSR1 checkpoints and exits with code 75. An expected failure (a refused config
value, a runtime missing, a task suite that cannot run: gyre.errors.UserError) prints `gyre: <message>`
and exits 1 (3: cells died), with its traceback only under `--verbose` or HYDRA_FULL_ERROR=1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gyre.config.domain import OneOf, fail
from gyre.config.load import check_overrides, normalize_overrides, register_configs, to_run_config
from gyre.config.schema import RunConfig, TaskSourceKind
from gyre.config.validate import check_run
from gyre.errors import reported, take_verbose_flag
from gyre.resume.preemption import PREEMPTED_EXIT_CODE, Preempted

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    with reported():
        cfg = to_run_config(dict_cfg)
        if not cfg.output_dir:
            cfg.output_dir = HydraConfig.get().runtime.output_dir
        if not cfg.tracking.run_name:  # one tracker run per Hydra (multirun) job, named by its overrides
            cfg.tracking.run_name = HydraConfig.get().job.override_dirname
        check_before_start(cfg)
        try:
            start(cfg)
        except Preempted:  # checkpointed; the same command (or the requeued job) resumes
            sys.exit(PREEMPTED_EXIT_CODE)


def check_before_start(cfg: RunConfig) -> None:
    """Everything a run can be refused for without starting anything: every config check (a model
    directory's files included), the task families (the registry is their domain), the sandbox (a site without
    user namespaces is told so before a warm start), then the task suite, which must load
    (gyre/tasks/source.py): its usable and skipped tasks are printed."""
    check_run(cfg)
    if cfg.model.path:  # the directory's config.json is the architecture; its files are checked against the run
        from gyre.model.pretrained import check_pretrained

        check_pretrained(cfg)
    check_families(cfg)
    from gyre.sandbox import make_sandbox
    from gyre.tasks.source import preflight_suite

    make_sandbox(cfg.sandbox)

    report = preflight_suite(cfg.tasks)
    if report:
        print(report, flush=True)


def check_families(cfg: RunConfig) -> None:
    from gyre.tasks.families import FAMILIES

    families = OneOf(tuple(sorted(FAMILIES)), "task family")
    families.check("tasks.families", cfg.tasks.families)
    families.check("warm_start.families", cfg.warm_start.families)
    if cfg.tasks.source == TaskSourceKind.builtin and not cfg.tasks.families:
        fail(
            "tasks.families",
            [],
            f"tasks.source=builtin needs families to draw tasks from; choose some of {', '.join(families.choices)}",
        )


def start(cfg: RunConfig) -> None:
    from gyre.sched.launch.local import local_plan  # heavy imports (torch, megatron) only once the config is valid
    from launch.launchers import Via, launcher_for

    plan = local_plan(cfg)
    launcher_for(cfg, Via.local).launch(plan)


def run_app(app: Callable[[], object]) -> None:
    """Check the command line's overrides (a mistyped key names the valid ones), then run the Hydra app."""
    sys.argv[1:] = normalize_overrides(take_verbose_flag(sys.argv[1:]))
    with reported():
        check_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
    app()


if __name__ == "__main__":
    run_app(main)
