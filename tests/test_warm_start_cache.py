"""The warm-start cache shared by runs that start together (a Hydra sweep's jobs on an empty cache): one
builds, the others wait for it and load what it built, and none replaces an entry another run may be loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre.config.load import compose
from gyre.fsutil import locked
from gyre.warm_start import _build_policy, cache_key, prepare_policy

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
TINY = ["warm_start.steps=2", "warm_start.demos=8", "warm_start.batch_size=4", "tokenizer.corpus_tasks=60",
        "tokenizer.vocab_size=512"]  # fmt: skip
# prepare_policy in a process of its own; prints its log lines and then the checkpoint it loaded
RUN = """
import sys
from gyre.config.load import compose
from gyre.warm_start import prepare_policy
policy = prepare_policy(compose(sys.argv[1:]), log=lambda line: print(line, flush=True))
print("loaded", policy.checkpoint_dir, len(policy.load_state()), flush=True)
"""


def test_a_run_that_finds_the_warm_start_being_built_waits_and_loads_that_one(tmp_path):
    args = [*TINY, f"warm_start.cache_dir={tmp_path}"]
    cfg = compose(args)
    root = tmp_path / f"policy-{cache_key(cfg)}"
    with locked(tmp_path / f".{root.name}.lock"):  # this test is the run building it
        other = subprocess.Popen([sys.executable, "-c", RUN, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        first = other.stdout.readline()  # blocks until the other run says something: here, that it waits
        assert first.strip() == f"gyre: another run is building the warm start {root}; waiting for it", first
        time.sleep(1.0)
        assert other.poll() is None and not root.exists()  # still waiting, and built nothing meanwhile
        built = _build_policy(cfg, root, log=lambda line: None, check=None)
        inode = (root / "meta.json").stat().st_ino
    out, _ = other.communicate(timeout=300)
    assert other.returncode == 0, out
    assert out.splitlines() == [f"gyre: reusing cached warm start {root}", f"loaded {built.checkpoint_dir} "
                                f"{len(built.load_state())}"]  # fmt: skip
    assert (root / "meta.json").stat().st_ino == inode  # the entry it waited for, not replaced
    assert json.loads((root / "meta.json").read_text())["key"] == cache_key(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{root.name}.lock", root.name]  # no build left behind


def test_the_lock_is_free_again_after_a_build(tmp_path):
    """A run that builds releases the lock (also when its build fails), so the next run does not wait."""
    cfg = compose([*TINY, f"warm_start.cache_dir={tmp_path}"])
    lines: list[str] = []
    policy = prepare_policy(cfg, log=lines.append)
    assert any(line.startswith("gyre: building tokenizer and warm start") for line in lines)
    other = compose([*TINY, "tokenizer.vocab_size=600", f"warm_start.cache_dir={tmp_path}"])

    def refuse(tokenizer: object) -> None:
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):  # a preflight that fails inside the lock
        prepare_policy(other, log=lines.append, check=refuse)
    assert not list(tmp_path.glob("*.tmp*"))  # the refused build left nothing behind
    lines.clear()
    prepare_policy(other, log=lines.append)
    assert not any("waiting" in line for line in lines) and any("building" in line for line in lines), lines
    assert prepare_policy(cfg, log=lines.append).checkpoint_dir == policy.checkpoint_dir
