"""`python -m launch.run [key=value ...]`: the main job (embedded default: local colocate run)."""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from gyre.config.load import ConfigKeyError, check_overrides, register_configs, to_run_config

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> None:
    cfg = to_run_config(dict_cfg)
    if not cfg.output_dir:
        cfg.output_dir = HydraConfig.get().runtime.output_dir
    from gyre.loop import run  # heavy imports (torch, megatron) only once the config is valid

    run(cfg)


if __name__ == "__main__":
    try:
        check_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
    except ConfigKeyError as e:
        sys.exit(f"gyre: {e}")
    main()
