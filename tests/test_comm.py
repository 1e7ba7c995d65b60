"""gyre/comm: the MPI control plane, Mooncake and gloo weight transfer, KV migration between engines.

The integration tests launch tests/comm_mpi_job.py for real under the venv's `mpirun` (MPICH from
PyPI) and check the JSON it writes. They fail, not skip, when mpirun or Mooncake is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.comm.control import CellLayout
from gyre.comm.flat import VersionMismatch, pack, read_version, unpack
from gyre.comm.kv_migration import KVMeta, SessionKV, session_kv_from_flat, session_kv_to_flat
from gyre.comm.messages import RoleSwitch
from gyre.config.schema import ModelConfig
from gyre.engine.batcher import Batcher, BatcherConfig
from gyre.engine.kv_session import import_session_kv
from gyre.model.llama import LlamaForCausalLM

JOB = Path(__file__).with_name("comm_mpi_job.py")
MPIRUN = Path(sys.executable).parent / "mpirun"


def run_job(scenario: str, ranks: int, tmp_path: Path, timeout: float = 300) -> dict:
    assert MPIRUN.exists(), (
        f"{MPIRUN} missing: install MPICH into the venv (`pip install mpi4py mpich`, tools/setup_env.sh)"
    )
    out = tmp_path / f"{scenario}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MC_LOG_LEVEL": "ERROR"}
    proc = subprocess.run(
        [str(MPIRUN), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(JOB), scenario, str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, (
        f"mpirun {scenario} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(out.read_text())


# ----- pure parts -----


@pytest.mark.unit
def test_flat_buffer_round_trip_is_bit_identical_and_versioned() -> None:
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(2, 2, dtype=torch.bfloat16),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
    }
    buffer, layout = pack(tensors, "step-3")
    assert read_version(buffer) == "step-3" and all(e.offset % 64 == 0 for e in layout.entries)
    back = unpack(buffer.clone(), layout, expect_version="step-3")
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with pytest.raises(VersionMismatch, match="step-3"):
        unpack(buffer, layout, expect_version="step-4")


@pytest.mark.unit
def test_cell_layout_and_messages_validate() -> None:
    layout = CellLayout.contiguous(4, [1, 2])
    assert layout.cells == ((1,), (2, 3)) and layout.cell_of(0) == -1 and layout.cell_of(3) == 1
    assert layout.workers == (1, 2, 3)
    with pytest.raises(ValueError, match="mpirun -n 4"):
        CellLayout.contiguous(3, [1, 2])
    with pytest.raises(ValueError, match="role"):
        RoleSwitch(0, "sleep")  # type: ignore[arg-type]


@pytest.mark.unit
def test_kv_import_refuses_other_weights_and_geometry() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=50, hidden_size=32, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64
    )
    batcher = Batcher(LlamaForCausalLM(cfg), BatcherConfig(max_context_tokens=64), weight_version="v1")
    meta = KVMeta("r", (1, 2, 3), 2, 2, 8, "float32", "v0")
    kv = SessionKV(meta, torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    with pytest.raises(ValueError, match="update this engine's weights"):
        import_session_kv(batcher, kv)
    buffer, layout = session_kv_to_flat(kv)
    back = session_kv_from_flat(buffer, layout, meta)
    assert torch.equal(back.k, kv.k) and torch.equal(back.v, kv.v)
    wrong = SessionKV(
        KVMeta("r", (1, 2, 3), 2, 1, 8, "float32", "v1"), torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8)
    )
    with pytest.raises(ValueError, match="kv_heads"):
        import_session_kv(batcher, wrong)
    ok = SessionKV(KVMeta("r", (1, 2, 3), 2, 2, 8, "float32", "v1"), kv.k, kv.v)
    assert import_session_kv(batcher, ok) == 3 and batcher.prefix.match(torch.tensor([1, 2, 3, 4]), 3)[0] == 3


@pytest.mark.integration
def test_mooncake_is_installed() -> None:
    from mooncake.engine import TransferEngine  # fails (not skips) without the wheel or libibverbs1

    assert TransferEngine is not None


# ----- real MPI jobs -----


@pytest.mark.integration
def test_controller_switches_cells_and_idle_ranks_do_not_spin(tmp_path: Path) -> None:
    res = run_job("control", 4, tmp_path)
    switches = res["switches"]
    assert [(s["cell"], s["role"]) for s in switches] == [(0, "train"), (1, "train"), (1, "rollout"), (0, "rollout")]
    for s in switches:
        expect_ranks = [1] if s["cell"] == 0 else [2, 3]
        assert [a["rank"] for a in s["acks"]] == expect_ranks
        assert all(a["role"] == s["role"] and a["cell"] == s["cell"] for a in s["acks"])
        assert all(a["cell_size"] == len(expect_ranks) for a in s["acks"])
        assert s["latency_s"] < 5.0
    assert sorted(i["rank"] for i in res["idle"]) == [1, 2, 3]
    for idle in res["idle"]:
        assert idle["idle_wall_s"] >= 1.9
        assert idle["idle_cpu_fraction"] < 0.05, idle  # less than 5% of one core while waiting
    assert res["micro_batches"] == {"micro_batches": [3, 4, 5]}
    assert "WeightVersion failed on rank 2" in res["error"] and "holds no weights for v9" in res["error"]


@pytest.mark.integration
def test_weight_pull_is_bit_identical_with_versions_through_mooncake_and_gloo(tmp_path: Path) -> None:
    res = run_job("weights", 3, tmp_path)
    pulls = res["pulls"]
    assert sorted((p["transport"], p["version"]) for p in pulls) == [
        ("gloo", "v1"),
        ("gloo", "v2"),
        ("mooncake", "v1"),
        ("mooncake", "v2"),
    ]
    for p in pulls:
        assert p["digest"] == p["published"], p  # the satellite's loaded state dict is bit-identical
    assert len({p["published"] for p in pulls}) == 2  # v1 and v2 really differ
    assert "VersionMismatch" in res["stale_error"] and "'v3'" in res["stale_error"]
    assert res["v2_after_v3"] == "v2"  # double buffering: v2 is still readable after v3 is published


@pytest.mark.integration
def test_kv_migration_between_engines_recomputes_nothing_and_matches_recompute(tmp_path: Path) -> None:
    res = run_job("kv", 2, tmp_path)
    assert res["weights_version"] == res["kv_version"] == "v1"
    assert res["kv_digest_received"] == res["kv_digest_sent"]
    assert res["kv_tokens"] == res["imported_tokens"] == res["prompt_tokens"] - 1
    # Every token that had keys/values on the source is reused: only the last sampled token is new.
    assert res["migrated_cached_tokens"] == res["prompt_tokens"] - 1
    assert res["recompute_cached_tokens"] == 0
    assert res["migrated_ids"] == res["recompute_ids"] == res["source_ids"]
    assert res["max_diff_vs_recompute"] < 1e-4
    assert res["max_diff_vs_source"] < 1e-4
    assert res["max_diff_vs_forward"] < 1e-4
    assert res["slot_max_diff_vs_forward"] < 1e-4


@pytest.mark.unit
def test_the_generic_transport_imports_no_engine_internals() -> None:
    """gyre/comm moves bytes between cells: importing its transports (and the KV session format) must not
    load the embedded engine, the model or the trainer."""
    code = (
        "import sys\n"
        "import gyre.comm.transfer, gyre.comm.kv_migration, gyre.comm.gloo_transport, gyre.comm.flat\n"
        "import gyre.comm.mooncake_transport, gyre.comm.control, gyre.comm.messages\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('gyre.engine', 'gyre.model', 'gyre.train', 'gyre.sched',"
        " 'gyre.proxy', 'megatron')))\n"
        "print(bad)\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


@pytest.mark.unit
def test_a_cell_waiting_for_the_policy_stops_when_the_controller_stops_first(tmp_path) -> None:
    """A run refused while the controller builds its warm start (a harness whose first request cannot fit): the
    one cell in the controller's process waited for policy.json until its 60 s join timed out; now the
    controller's Shutdown ends the wait. Mail after the policy is written leaves the paths to the cell."""
    from gyre.comm.local_control import CELL_RANK, local_control_planes
    from gyre.comm.messages import Shutdown
    from gyre.sched.runtime import POLICY_FILE, policy_paths

    controller, cell = local_control_planes()
    controller.send(CELL_RANK, Shutdown("the controller stopped", finalize=False))
    with pytest.raises(RuntimeError, match="the controller stopped before writing policy.json"):
        policy_paths(tmp_path, cell, "start-1")
    paths = {"start_id": "start-1", "model": {}, "checkpoint_dir": "c", "tokenizer_dir": "t", "resume_from": ""}
    (tmp_path / POLICY_FILE).write_text(json.dumps({**paths, "version": 0}))
    controller.send(CELL_RANK, Shutdown("later", finalize=False))
    got = policy_paths(tmp_path, cell, "start-1")
    assert got["tok"].name == "t" and got["version"] == 0 and cell.has_mail()
