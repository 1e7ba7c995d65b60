"""Following a job on the local Slurm cluster through requeues (tests/test_slurm_requeue.py,
tests/test_slurm_cell_job.py)."""

import subprocess
import time
from pathlib import Path

from launch.slurm.preflight import parse_records

# states a job never leaves; anything else is on its way (Slurm lists more transitional states than these)
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                   "DEADLINE")  # fmt: skip


REQUEUE_SETTLE_S = 5.0
_held_since: dict[tuple[str, str], float] = {}


def job_record(job: str) -> dict[str, str]:
    """The job's scontrol record; {} when slurmctld does not answer (it times out on a busy machine)."""
    proc = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60)
    records = parse_records(proc.stdout) if proc.returncode == 0 else []
    return records[0] if records else {}


def job_active(job: str) -> bool:
    """Whether the job is still on its way (records stay MinJobAge=300 s, so no answer means ask again).
    A requeued job waits for its BeginTime (now + 120 s in Slurm 22.05): it is started at once."""
    record = job_record(job)
    state = record.get("JobState", "PENDING")
    if state == "PENDING" and record.get("Reason") == "BeginTime":
        # Slurm's 120 s hold also lets the previous instance's batch step finish exiting; starting the job
        # again while it still runs makes the launch fail (exit 1, run time 0). Skip the hold, not that.
        held_since = _held_since.setdefault((job, record.get("Restarts", "")), time.monotonic())
        if time.monotonic() - held_since > REQUEUE_SETTLE_S:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], timeout=60)
    if state in ("REQUEUE_HOLD", "SPECIAL_EXIT"):  # held on its way back: let it run
        subprocess.run(["scontrol", "release", job], timeout=60)
    if state in TERMINAL_STATES:
        print(f"job {job} ended: {record}")  # shown with the failure
    return state not in TERMINAL_STATES  # transitional states (REQUEUED, REQUEUE_FED, ...) are still on the way


def wait_for_end(job: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while job_active(job):
        if time.monotonic() > deadline:
            return "TIMEOUT"
        time.sleep(0.2)
    return job_record(job).get("JobState", "UNKNOWN")


def mpich_segments() -> set[Path]:
    """MPICH's shared memory on the nodes (all on this machine): a world that ends without MPI_Finalize leaves
    its segments unless the job's script removes them (launch/slurm/sbatch.py: remove_mpich_leftovers)."""
    return set(Path("/dev/shm").glob("mpich_shm_*"))
