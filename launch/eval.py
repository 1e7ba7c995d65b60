"""`python -m launch.eval [key=value ...]`: evaluate a checkpoint, a model.path HF directory or the warm start.

The same Hydra config as launch.run. eval.checkpoint=<a run's checkpoint/ dir> evaluates its weights
(empty: model.path, else the warm start); the tasks are the held-out split of `tasks` (eval.held_out=true)
or eval.tasks; eval.samples rollouts per task at eval.temperature. Writes metrics.jsonl (one `event: eval`
row), shards_eval/ (kind=eval) and eval/v<version>-tasks.{csv,json} in output_dir, prints the table. Runs
on this machine (one local cell); on Slurm, `python -m launch.submit --eval ...` runs it as a one-node job.
"""

from __future__ import annotations

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gyre.config.load import register_configs, to_run_config
from gyre.errors import reported
from launch.run import check_before_start, run_app

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    with reported():
        cfg = to_run_config(dict_cfg)
        if not cfg.output_dir:
            cfg.output_dir = HydraConfig.get().runtime.output_dir
        check_before_start(cfg)
        from gyre.sched.launch.evaluate import evaluate, table_text

        out = Path(cfg.output_dir)
        row = evaluate(cfg, out)
        print(table_text(out, row), flush=True)


if __name__ == "__main__":
    run_app(main)
