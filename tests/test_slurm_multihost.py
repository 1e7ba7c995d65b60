"""What goes wrong when cells live on different hosts, on the multi-host test cluster (slurm/cluster.sh
--hosts netns: each node its own address, hostname and /etc/hosts). Each case is refused before the
cells start, or ends as a dead cell with a non-zero exit: never a silent COMPLETED. The runs that work
there are in tests/test_slurm_cell_job.py."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import CELL_WORKLOAD, slurm_host_modes
from slurm_jobs import job_record
from test_slurm_cell_job import ROOT, _wait_for_end, job_logs

from gyre.sched.launch.local import DEAD_CELLS_EXIT_CODE
from launch.submit import main as submit_main

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]
NETNS = slurm_host_modes("netns")


def submit(out: Path, capsys, *overrides: str) -> str:
    args = ["--via", "sbatch", "--out", str(out), "cluster=slurm_cpu", f"cluster.python={sys.executable}"]
    submit_main([*args, f"cluster.workdir={ROOT}", *CELL_WORKLOAD, "steps=1", *overrides])
    return capsys.readouterr().out.split("submitted job ")[1].split(";")[0]


@contextmanager
def hosts_line(node: str, line: str) -> Iterator[None]:
    """Replace `node`'s own line in its /etc/hosts (bind-mounted from the cluster's DIR/hosts/<node>, so
    edited in place) with `line`, as Debian's installer writes it."""
    path = Path(os.environ["SLURM_CONF"]).parent / "hosts" / node
    before = path.read_text()
    path.write_text("".join(f"{line}\n" if f" {node}" in row else row for row in before.splitlines(keepends=True)))
    try:
        yield
    finally:
        path.write_text(before)


@pytest.mark.parametrize("slurm_hosts", NETNS, indirect=True)
def test_loopback_addresses_are_refused_before_submitting(tmp_path: Path, slurm_hosts: str, capsys) -> None:
    """The old loopback defaults: nodes with their own NodeAddr cannot reach each other's 127.0.0.1."""
    with pytest.raises(SystemExit) as info:
        submit(tmp_path / "run", capsys, "comm.hostname=127.0.0.1", "engine.host=127.0.0.1")
    text = str(info.value)
    assert "separate hosts" in text and "set comm.hostname=auto" in text and "set engine.host=0.0.0.0" in text
    assert "submitted job" not in capsys.readouterr().out


@pytest.mark.parametrize("slurm_hosts", NETNS, indirect=True)
def test_a_node_resolving_itself_to_127_0_1_1_is_refused_before_the_cells_start(
    tmp_path: Path, slurm_hosts: str, capsys
) -> None:
    out = tmp_path / "run"
    with hosts_line("node2", "127.0.1.1 node2"):
        job = submit(out, capsys)
        state = _wait_for_end(job, 300)
    logs = job_logs(out)
    assert state == "FAILED", f"{state}\n{logs}"
    assert "the cell job cannot start" in logs and "cell 1 on node2 (rank 2) would advertise 127.0.1.1" in logs, logs
    assert "comm.interface" in logs
    assert not (out / "cells.json").exists() and not (out / "calls.jsonl").exists()  # no engine, no rollout started


@pytest.mark.parametrize("slurm_hosts", NETNS, indirect=True)
def test_an_unreachable_engine_is_a_dead_cell_and_the_job_fails(tmp_path: Path, slurm_hosts: str, capsys) -> None:
    """Cell 2's engine seen at an address where nothing listens (injected): the run goes on without it,
    lists it as dead with the reason, and the job fails with the controller's exit code 3 (DEAD_CELLS_EXIT_CODE:
    sched.allow_dead_cells is not set; the job that allows them: tests/test_slurm_cell_job.py)."""
    out = tmp_path / "run"
    job = submit(out, capsys, "sched.faults=[unreachable_engine:2:after_calls:0]")
    state = _wait_for_end(job, 600)
    logs = job_logs(out)
    assert state == "FAILED", f"{state}\n{logs}"
    assert job_record(job).get("ExitCode") == f"{DEAD_CELLS_EXIT_CODE}:0", f"{job_record(job)}\n{logs}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["dead_cells"] == [2], summary
    assert "is unreachable from the controller" in summary["dead_cell_reasons"]["2"]
    assert "Set sched.allow_dead_cells=true" in logs
    engine_urls = {json.loads(line)["engine_url"] for line in (out / "calls.jsonl").open()}
    assert len(engine_urls) == 2  # the two living cells served every call


@pytest.mark.parametrize("slurm_hosts", NETNS, indirect=True)
def test_gloo_is_refused_before_submitting(tmp_path: Path, slurm_hosts: str, capsys) -> None:
    """gloo across hosts (comm.hostname=auto): the store now sits at rank 0's resolved address, but each
    cell's Megatron replica would build its groups in the one world over every rank, and hang."""
    with pytest.raises(SystemExit) as info:
        submit(tmp_path / "run", capsys, "comm.transfer_backend=gloo")
    assert "comm.transfer_backend=gloo" in str(info.value) and "use comm.transfer_backend=mooncake" in str(info.value)
    assert "submitted job" not in capsys.readouterr().out
