"""The main job under Slurm, stopped twice mid-run: by the time-limit signal (`--signal=B:TERM`, sent here
with `scancel --batch --signal=TERM`, which the script passes on and then requeues the job itself) and by
`scontrol requeue`. Each time it resumes from its checkpoint, and the shards hold every rollout of every
step exactly once (local cluster of slurm/cluster.sh)."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from resume_job import (
    ROOT,
    STEPS,
    adam_steps,
    assert_each_rollout_once,
    in_flight_after_a_step,
    tiny_args,
    wait_until,
)
from slurm_jobs import job_active, wait_for_end

from gyre.config.load import compose
from launch.slurm.sbatch import render_main_job_sbatch

pytestmark = pytest.mark.slurm


def _resumed_at(text: str, out: Path, restart: int) -> int | None:
    """The step the run resumed at in Slurm restart `restart`, once it says so."""
    found = re.search(rf"resuming {re.escape(str(out))} from \S+ at step (\d+) of {STEPS}.*restart {restart}\)", text)
    return int(found[1]) if found else None


def test_stopped_main_job_resumes_from_its_checkpoint(tmp_path):
    out = tmp_path / "run"
    args = tiny_args(out, tmp_path / "hydra", "checkpoint_every=1")
    cfg = compose(["cluster=slurm_cpu", f"cluster.workdir={ROOT}", "cluster.job_name=gyre-requeue"])
    script = tmp_path / "main.sbatch"
    script.write_text(render_main_job_sbatch(cfg, [sys.executable, "-m", "launch.run", *args], str(tmp_path)))
    proc = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    log = tmp_path / f"{job}_main.out"
    try:
        # The first stop comes once step 0 is done, trained or not (its rewards may all be equal): stopping
        # after the first trained step could leave no room for a second stop before the last step.
        wait_until("rollouts after the first step", lambda: in_flight_after_a_step(out), 300, lambda: job_active(job))
        # what --signal=B:TERM does before the time limit: only the batch shell gets it
        subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True, timeout=30)
        first_resume = wait_until("the resume after the first stop", lambda: _resumed_at(log.read_text(), out, 1),
                                  180, lambda: job_active(job))  # fmt: skip
        wait_until("rollouts after a resumed step", lambda: in_flight_after_a_step(out, first_resume), 300,
                   lambda: job_active(job))  # fmt: skip
        subprocess.run(["scontrol", "requeue", job], check=True, timeout=30)
        final_state = wait_for_end(job, 300)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = log.read_text()
    assert final_state == "COMPLETED", f"{final_state}\n{text[-4000:]}"
    for restart in (0, 1, 2):
        assert f"gyre: job {job} (restart {restart})" in text, text[-4000:]
    assert "stopped by SIGTERM" in text.split("(restart 1)")[0]  # the run itself saw the first stop
    second_resume = _resumed_at(text, out, 2)
    assert second_resume is not None and first_resume < second_resume, text[-4000:]
    final = assert_each_rollout_once(out)
    expected_starts = [0] * first_resume + [1] * (second_resume - first_resume) + [2] * (STEPS - second_resume)
    assert [r["start"] for r in final["ledger"]] == expected_starts
    assert adam_steps(out) == sum(1 for r in final["ledger"] if r["trained"]), "optimizer state not carried over"
    for resumed in (first_resume, second_resume):
        assert f"moved outputs of unfinished steps >= {resumed} aside" in text, text[-4000:]
    asides = sorted((out / "preempted").iterdir())
    assert [int(a.name[len("step") : len("step00000")]) for a in asides] == [first_resume, second_resume]
    for aside, step in zip(asides, (first_resume, second_resume), strict=True):  # what each stop abandoned
        abandoned = {json.loads(line)["rollout_id"] for line in (aside / "calls.jsonl").read_text().splitlines()}
        assert abandoned and all(rid.startswith(f"s{step}-") for rid in abandoned), abandoned
    assert [(s.get("slurm_job_id"), s.get("slurm_restart_count", "0")) for s in final["starts"]] == [
        (job, "0"),
        (job, "1"),
        (job, "2"),
    ]
