"""`python -m launch.probe [key=value ...]`: resolve the config, report where it ran, do no work.

A tiny Hydra app with the main job's config, for checking sweeps and cluster setups (e.g. a
multirun through hydra-submitit-launcher); writes probe.json into its own output directory.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gyre.config.load import register_configs, to_run_config
from gyre.errors import reported
from launch.run import run_app

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> dict[str, object]:
    with reported():
        cfg = to_run_config(dict_cfg)
    out = Path(HydraConfig.get().runtime.output_dir)
    report: dict[str, object] = {
        "scheduler": cfg.scheduler,
        "seed": cfg.seed,
        "output_dir": str(out),
        "host": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_node": os.environ.get("SLURMD_NODENAME"),
    }
    (out / "probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    run_app(main)
