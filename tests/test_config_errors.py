"""An expected failure, through the real entry points: its one message, a non-zero exit, no traceback
(unless asked for with HYDRA_FULL_ERROR=1 or --verbose)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SGLANG_MISSING = "engine.backend=sglang: python cannot serve SGLang on this node"


def run_module(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def quiet_env() -> dict[str, str]:
    return {"HYDRA_FULL_ERROR": "", "GYRE_VERBOSE": ""}


def run_args(tmp_path: Path, *overrides: str) -> list[str]:
    return [*overrides, f"output_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}"]


def assert_one_message(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode != 0, proc.stdout[-2000:]
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].startswith(f"gyre: {message}"), proc.stderr[-4000:]
    assert out.count(message) == 1, out[-4000:]


def test_a_refused_value_is_one_line_before_anything_starts(tmp_path):
    proc = run_module("launch.run", *run_args(tmp_path, "rl.group_size=-3"), env=quiet_env())
    assert_one_message(proc, "rl.group_size=-3: must be >= 2")
    assert proc.returncode == 1 and proc.stdout == ""
    assert not (tmp_path / "run").exists()  # nothing started: no output directory


def test_a_run_that_would_train_nothing_refuses_instead_of_exiting_0(tmp_path):
    proc = run_module("launch.run", *run_args(tmp_path, "steps=0"), env=quiet_env())
    assert_one_message(proc, "steps=0: must be >= 1 (a run of no steps trains nothing)")


def test_the_traceback_is_there_when_asked_for(tmp_path):
    full = run_module("launch.run", *run_args(tmp_path, "sched.staleness=-1"), env={"HYDRA_FULL_ERROR": "1"})
    assert full.returncode != 0
    assert "Traceback" in full.stderr and "sched.staleness=-1: must be >= 0" in full.stderr, full.stderr[-3000:]
    verbose = run_module("launch.run", "--verbose", *run_args(tmp_path, "sched.staleness=-1"), env=quiet_env())
    assert verbose.returncode != 0
    assert "Traceback" in verbose.stderr and "ConfigValueError" in verbose.stderr, verbose.stderr[-3000:]


def test_a_task_suite_that_cannot_run_is_one_message(tmp_path):
    args = run_args(tmp_path, "tasks.source=harbor", "tasks.path=/nonexistent", "warm_start.enabled=false")
    proc = run_module("launch.run", *args, env=quiet_env())
    assert_one_message(proc, "tasks.path='/nonexistent' is not a directory of Harbor tasks")
    checked = run_module("tools.check_tasks", "/nonexistent", env=quiet_env())
    assert_one_message(checked, "tasks.path='/nonexistent' is not a directory of Harbor tasks")


def test_launch_submit_refuses_in_one_line(tmp_path):
    proc = run_module("launch.submit", "--dry-run", f"--out={tmp_path / 'job'}", "cluster=slurm_cpu",
                      "scheduler=elastic", "sched.capacity_per_cell=0", env=quiet_env())  # fmt: skip
    assert_one_message(proc, "sched.capacity_per_cell=0: must be >= 1")
    assert not (tmp_path / "job").exists()


def test_sglang_missing_in_a_cell_job_reaches_the_user_once(tmp_path):
    """Every cell rank finds SGLang's runtime missing (this machine has no CUDA build of it); the first
    one's message is printed once by launch.run, not once per rank inside tracebacks. The ranks MPI_Abort
    ends leave nothing in TMPDIR (wandb, which megatron imports where installed, is kept out of them), nor
    MPICH its topology file in /tmp and its shared memory in /dev/shm (gyre.sched.launch.mpich_leftovers)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    mpich_before = _mpich_files()
    args = run_args(
        tmp_path, "engine=sglang", "scheduler=elastic", "sched.kv_migration=false", "steps=1",
        "warm_start.enabled=false", "tokenizer.corpus_tasks=60", "tokenizer.vocab_size=512",
        f"warm_start.cache_dir={tmp_path / 'cache'}",
    )  # fmt: skip
    proc = run_module("launch.run", *args, env={**quiet_env(), "TMPDIR": str(tmp)}, timeout=600)
    assert_one_message(proc, SGLANG_MISSING)
    assert "MPI_Abort" not in proc.stderr
    assert "engine.python" in proc.stderr  # what to do about it
    assert not list(tmp.glob("tmp*wandb-*"))
    assert not _mpich_files() - mpich_before


def _mpich_files() -> set[Path]:
    return {*Path("/tmp").glob("hydra_hwloc_xmlfile_*"), *Path("/dev/shm").glob("mpich_shm_*")}


def test_a_missing_mpirun_is_one_message(tmp_path):
    args = run_args(tmp_path, "scheduler=elastic", "sched.mpirun=/nonexistent/mpirun")
    proc = run_module("launch.run", *args, env=quiet_env())
    assert_one_message(proc, "sched.mpirun='/nonexistent/mpirun': not found: `pip install mpi4py mpich`")


@pytest.mark.unit
def test_a_vocabulary_that_tensor_parallel_ranks_cannot_split_is_refused_by_name():
    """The trained tokenizer's size is known only once the warm start exists (511 tokens, TP 2 stopped every
    rank with an assertion inside megatron before this)."""
    from gyre.errors import UserError
    from gyre.sched.runtime import check_vocab_splits

    check_vocab_splits(498, 2)
    with pytest.raises(UserError, match="train.tensor_parallel=2: the warm start's tokenizer has 511 tokens"):
        check_vocab_splits(511, 2)
