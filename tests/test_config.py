import subprocess
import sys
from pathlib import Path

import pytest

from gyre.config.load import ConfigKeyError, check_key, compose
from gyre.config.schema import RunConfig
from gyre.config.validate import ConfigValueError

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[1]


def test_default_config_is_the_embedded_colocate_run():
    cfg = compose()
    assert isinstance(cfg, RunConfig)
    assert cfg.scheduler == "colocate"
    assert cfg.engine.backend == "embedded"
    assert cfg.train.backend == "megatron"


def test_overrides_are_typed():
    cfg = compose(["rl.group_size=6", "steps=3", "tasks.families=[write_value]"])
    assert cfg.rl.group_size == 6 and cfg.steps == 3 and cfg.tasks.families == ["write_value"]
    with pytest.raises(Exception, match="group_size"):
        compose(["rl.group_size=many"])


def test_mistyped_key_names_the_key_and_the_valid_ones():
    with pytest.raises(ConfigKeyError) as info:
        check_key("rl.gruop_size")
    msg = str(info.value)
    assert "rl.gruop_size" in msg and "group_size" in msg and "clip_eps_low" in msg
    assert "Did you mean 'rl.group_size'" in msg
    with pytest.raises(ConfigKeyError, match="Valid keys there: .*steps"):
        check_key("stpes")


def test_cli_rejects_unknown_key_with_clear_message():
    proc = subprocess.run(
        [sys.executable, "-m", "launch.run", "harness.timeout=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "unknown config key 'harness.timeout'" in proc.stderr
    assert "timeout_s" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_schema_and_cli_config_import_without_heavy_backends():
    code = (
        "import sys; import gyre.config.schema, gyre.config.load; from gyre.config.load import compose; compose();"
        "heavy = [m for m in ('torch', 'megatron', 'sglang', 'mooncake') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_unsupported_choices_fail_before_any_work():
    from gyre.sched.launch.local import check_supported

    for scheduler in ("colocate", "colocate_cells", "async", "elastic"):  # configurations of the one controller
        check_supported(compose([f"scheduler={scheduler}"]))
    # unknown choices are refused where the config is loaded, naming the key, the value and what it may be
    with pytest.raises(ConfigValueError, match="scheduler='bogus': unknown scheduler; choose one of colocate, "):
        compose(["scheduler=bogus"])
    with pytest.raises(ConfigValueError, match="train.backend='fsdp': choose one of megatron"):
        compose(["train.backend=fsdp"])
    with pytest.raises(ConfigValueError, match="rl.algorithm='ppo': .*choose one of gspo"):
        compose(["rl.algorithm=ppo"])
