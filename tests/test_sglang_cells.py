"""SGLang engines in cells: the servers a cell starts (one per tensor-parallel group, over several nodes
when engine.tp_size exceeds a node), their command lines parsed by SGLang's own parser, the switch
sequence and distributed weight updates driven through the RolloutEngine interface against a server that
joins the broadcast group with SGLang's own code, and the failure when SGLang's runtime is missing."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from sglang_io import parse_like_sglang, parse_server_argv

from gyre.config.schema import EngineConfig, ModelConfig
from gyre.engine import admin_key, sglang_backend
from gyre.engine.client import SyncEngineClient
from gyre.engine.engine import EngineServers, EngineSetup, make_engine
from gyre.engine.sglang_backend import SGLangEngine, SGLangUnavailable, launch_command, plan_servers
from gyre.engine.switch import join_rollout, leave_rollout
from gyre.model.random_model import SHAPES, random_hf_state

ROOT = Path(__file__).resolve().parents[1]
GPU = EngineConfig(backend="sglang", tp_size=2, port=30000, mem_fraction_static=0.7, dtype="bfloat16",
                   host="0.0.0.0")  # fmt: skip
MODEL = SHAPES["qwen3-0.6b"]


def parsed(argv: list[str]):
    ns, unknown = parse_server_argv(argv)
    assert not unknown, f"flags SGLang does not declare: {unknown}"
    return ns


@pytest.mark.unit
def test_a_node_of_eight_gpus_serves_one_server_per_tp_group():
    plan = plan_servers("/models/p", GPU, MODEL, nodes=["n0"], gpus_per_node=8, weight_version="3")
    got = [(p.server, p.node, p.port, parsed(p.argv)) for p in plan]
    assert [(s, n, port) for s, n, port, _ in got] == [(0, "n0", 30000), (1, "n0", 30001), (2, "n0", 30002),
                                                       (3, "n0", 30003)]  # fmt: skip
    for k, (_, _, port, ns) in enumerate(got):
        assert (ns.tp_size, ns.base_gpu_id, ns.port, ns.nnodes, ns.node_rank) == (2, 2 * k, port, 1, 0)
        assert ns.mem_fraction_static == 0.7 and ns.enable_memory_saver and ns.weight_version == "3"
        assert ns.dist_init_addr is None and ns.host == "0.0.0.0"
    assert all(launch_command(GPU, p, "n0")[:3] == ["python", "-m", "sglang.launch_server"] for p in plan)


@pytest.mark.unit
def test_tp_over_two_nodes_spans_them_with_a_rendezvous_on_the_first():
    cfg = dataclasses.replace(GPU, tp_size=16)
    plan = plan_servers("/models/p", cfg, MODEL, nodes=["n0", "n1", "n2", "n3"], gpus_per_node=8)
    layout = [(p.server, p.node, p.node_rank, p.serves_http) for p in plan]
    assert layout == [(0, "n0", 0, True), (0, "n1", 1, False), (1, "n2", 0, True), (1, "n3", 1, False)]
    for p in plan:
        ns = parsed(p.argv)
        head = "n0" if p.server == 0 else "n2"
        assert (ns.tp_size, ns.nnodes, ns.node_rank, ns.dist_init_addr) == (16, 2, p.node_rank, f"{head}:30050")
        assert (ns.port, ns.base_gpu_id) == (30000, 0)


@pytest.mark.unit
def test_server_command_lines_golden(monkeypatch, tmp_path):
    monkeypatch.setattr(admin_key, "_key", "run-admin-key")  # the run's key, made per run (gyre.engine.admin_key)
    cfg = dataclasses.replace(GPU, tp_size=16)
    plan = plan_servers("/models/p", cfg, MODEL, nodes=["n0", "n1"], gpus_per_node=8, weight_version="7",
                        key_dir=tmp_path)  # fmt: skip
    key_file = tmp_path / f"engine-admin-key-{os.getpid()}.yaml"
    assert launch_command(cfg, plan[0], "n0") == [
        "python", "-m", "sglang.launch_server",
        "--model-path", "/models/p", "--host", "0.0.0.0", "--port", "30000", "--tp-size", "16",
        "--mem-fraction-static", "0.7", "--max-running-requests", "64", "--context-length", "4096",
        "--dtype", "bfloat16", "--load-format", "auto", "--weight-version", "7", "--random-seed", "0",
        "--base-gpu-id", "0", "--log-level", "info", "--config", str(key_file),
        "--enable-memory-saver", "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "n0:30050",
    ]  # fmt: skip
    assert key_file.read_text() == 'api-key: "run-admin-key"\nadmin-api-key: "run-admin-key"\n'
    assert key_file.stat().st_mode & 0o777 == 0o600  # the run's user only; the command line holds no key
    remote = launch_command(cfg, plan[1], "n0")
    assert remote[:6] == ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n1", "--kill-on-bad-exit=1"]
    assert remote[6:9] == ["python", "-m", "sglang.launch_server"] and remote[-4:-2] == ["--node-rank", "1"]


@pytest.mark.unit
def test_layouts_that_cannot_be_served_fail_with_the_reason():
    with pytest.raises(ValueError, match="tp_size=3 does not divide the cell's 8 GPUs"):
        plan_servers("/m", dataclasses.replace(GPU, tp_size=3), None, ["n0"], 8)
    with pytest.raises(ValueError, match="needs whole nodes"):
        plan_servers("/m", dataclasses.replace(GPU, tp_size=16), None, ["n0", "n1", "n2"], 8)
    with pytest.raises(ValueError, match="engine.port=0 cannot pick free ports on other nodes"):
        plan_servers("/m", dataclasses.replace(GPU, port=0), None, ["n0", "n1"], 8)


@pytest.mark.unit
def test_cell_jobs_refuse_sglang_settings_they_cannot_honour():
    from gyre.config.load import compose
    from gyre.config.validate import ConfigValueError, check_engine_in_cells

    cfg = compose(["cluster=slurm_gpu"])
    check_engine_in_cells(cfg)  # the GPU preset: one 8-GPU node per cell, tp 8, no KV migration
    with pytest.raises(ConfigValueError, match="sched.kv_migration"):
        check_engine_in_cells(dataclasses.replace(cfg, sched=dataclasses.replace(cfg.sched, kv_migration=True)))
    with pytest.raises(ConfigValueError, match="one SGLang server per cell"):
        check_engine_in_cells(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, tp_size=4)))


@pytest.fixture
def fake_sglang(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = tmp_path / "requests.jsonl"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fake_sglang_server.py"), str(port), str(record)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not SyncEngineClient(url, timeout_s=2).health():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.2)
    yield url, record
    try:
        SyncEngineClient(url, timeout_s=5).post("/shutdown")
    except Exception:  # noqa: BLE001 - it exits while answering
        pass
    proc.wait(30)


@pytest.mark.integration
def test_role_switch_and_distributed_weights_through_the_engine_interface(fake_sglang, tmp_path, monkeypatch):
    url, record = fake_sglang
    monkeypatch.setattr(sglang_backend, "WEIGHT_GROUP_BACKEND", "gloo")  # nccl on GPUs
    setup = EngineSetup(SHAPES["qwen3-tiny"], None, tmp_path, tmp_path / "scratch")
    engine = make_engine(EngineConfig(backend="sglang", tp_size=1), setup)
    assert isinstance(engine, SGLangEngine) and engine.weight_sync == "distributed"
    engine.servers = EngineServers([url])  # as start() leaves it, with the server already up
    state = random_hf_state(SHAPES["qwen3-tiny"], seed=3, dtype=torch.float32)
    leave_rollout(engine, pause_mode="abort")
    join_rollout(engine, lambda: engine.update_weights(state, "4"))
    engine.update_weights({k: v * 2 for k, v in state.items()}, "5")  # the group is opened once, reused
    info = SyncEngineClient(url).server_info()
    expected = sum(float(t.double().sum()) for t in state.values()) * 3
    assert info["weight_version"] == "5" and engine.version == "5"
    assert abs(info["received_sum"] - expected) < 1e-2 * max(1.0, abs(expected))
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    order = [r["path"] for r in sent if r["path"] not in ("/health", "/get_server_info")]
    assert order == ["/pause_generation", "/release_memory_occupation", "/resume_memory_occupation",
                     "/init_weights_update_group", "/update_weights_from_distributed", "/resume_memory_occupation",
                     "/continue_generation", "/update_weights_from_distributed"]  # fmt: skip
    for r in sent:
        if r["body"] is not None and r["path"] != "/health":
            parse_like_sglang(r["path"], r["body"])
    updates = [parse_like_sglang(r["path"], r["body"]) for r in sent if r["path"] == "/update_weights_from_distributed"]
    assert [u.weight_version for u in updates] == ["4", "5"] and updates[0].names == list(state)
    group = parse_like_sglang("/init_weights_update_group", next(r["body"] for r in sent if "init" in r["path"]))
    assert (group.rank_offset, group.world_size, group.backend) == (1, 2, "gloo")
    resumes = [r["body"].get("tags") for r in sent if r["path"] == "/resume_memory_occupation"]
    assert resumes == [["weights"], ["kv_cache"]]


@pytest.mark.integration
def test_without_sglangs_runtime_a_cell_fails_saying_what_to_install(tmp_path):
    from gyre.engine.engine import EngineSetup
    from gyre.sched.cell.engine import CellEngine

    cfg = EngineConfig(backend="sglang", python=sys.executable)
    setup = EngineSetup(ModelConfig(), tmp_path / "tok", tmp_path / "logs", tmp_path / "weights")
    with pytest.raises(SGLangUnavailable, match=r"missing sgl_kernel[\s\S]*pip install \"sglang\[all\]\""):
        CellEngine(cfg, setup, tmp_path / "ckpt")
    assert not list((tmp_path / "logs").glob("sglang*.log"))  # failed before launching anything


@pytest.mark.integration
def test_without_sglangs_runtime_the_colocate_run_fails_saying_what_to_install(tmp_path):
    """scheduler=colocate's one cell (gyre.sched.launch.in_process) starts its engine as every cell does."""
    from gyre.config.load import compose
    from gyre.engine.engine import EngineSetup, make_engine
    from gyre.model.random_model import create_random_model
    from gyre.sched.cell.engine import CellEngine

    cfg = compose(["engine=sglang", f"engine.python={sys.executable}", f"output_dir={tmp_path}"])
    model = create_random_model(tmp_path / "policy", SHAPES["qwen3-tiny"], seed=0, dtype=torch.float32)
    setup = EngineSetup(SHAPES["qwen3-tiny"], model, tmp_path, tmp_path / "weights")
    assert isinstance(make_engine(cfg.engine, setup), SGLangEngine)  # engine.backend selects it, through the factory
    with pytest.raises(SGLangUnavailable, match=r"missing sgl_kernel[\s\S]*engine.backend=embedded"):
        CellEngine(cfg.engine, setup, model, kv_transfer=False, keep_scratch=True)
