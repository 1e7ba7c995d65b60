"""SGLang engines in cells: the servers a cell starts (one per tensor-parallel group, over several nodes
when engine.tp_size exceeds a node), their command lines parsed by SGLang's own parser, the switch
sequence and distributed weight updates driven through the RolloutEngine interface against a server that
joins the broadcast group with SGLang's own code, and the failure when SGLang's runtime is missing."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sglang_io import parse_like_sglang, parse_server_argv

from gyre.config.schema import EngineConfig, ModelConfig
from gyre.engine import admin_key, sglang_backend
from gyre.engine.client import EngineError, SyncEngineClient
from gyre.engine.engine import EngineServers, EngineSetup, make_engine
from gyre.engine.sglang_backend import SGLangEngine, SGLangUnavailable, launch_command, plan_servers
from gyre.engine.switch import join_rollout, leave_rollout, update_while_serving
from gyre.model.random_model import SHAPES, create_random_model, random_hf_state

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
    with pytest.raises(ValueError, match=r"tp_size=2 x pp_size=3 \(6 GPUs\) does not divide the cell's 8 GPUs"):
        plan_servers("/m", dataclasses.replace(GPU, pp_size=3, weight_sync="disk"), None, ["n0"], 8)
    with pytest.raises(ValueError, match="engine.port=0 cannot pick free ports on other nodes"):
        plan_servers("/m", dataclasses.replace(GPU, port=0), None, ["n0", "n1"], 8)


@pytest.mark.unit
def test_cell_jobs_refuse_sglang_settings_they_cannot_honour():
    from gyre.config.load import compose
    from gyre.config.validate import ConfigValueError, check_engine_in_cells, check_run

    cfg = compose(["cluster=slurm_gpu"])
    check_engine_in_cells(cfg)  # the GPU preset: 2 nodes of 8 GPUs per cell, TP 8 x PP 2, no KV migration
    with pytest.raises(ConfigValueError, match="sched.kv_migration"):
        check_engine_in_cells(dataclasses.replace(cfg, sched=dataclasses.replace(cfg.sched, kv_migration=True)))
    with pytest.raises(ConfigValueError, match="one SGLang server per cell"):
        check_engine_in_cells(dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, tp_size=4)))
    # the server shares the trainer's GPUs: no NCCL group of both; it spans 2 nodes: no CUDA IPC handles (as TP 16)
    for sync, why in (("auto", "resolves to distributed.*Duplicate GPU"), ("distributed", ".*Duplicate GPU"),
                      ("tensor", ".*cell 0's server spans 2 nodes")):  # fmt: skip
        tp16 = dataclasses.replace(cfg.engine, tp_size=16, pp_size=1, weight_sync=sync)
        with pytest.raises(ConfigValueError, match=f"engine.weight_sync='{sync}': {why}"):
            check_engine_in_cells(dataclasses.replace(cfg, engine=tp16))
        resolves = "distributed" if sync == "auto" else sync
        with pytest.raises(ConfigValueError, match=f"engine.pp_size=2: needs engine.weight_sync=disk .*{resolves}"):
            dataclasses.replace(cfg.engine, weight_sync=sync)  # the preset's PP 2: a group would collide
    small = compose(["cluster=slurm_gpu_small"])
    assert (cfg.engine.weight_sync, small.engine.weight_sync) == ("disk", "tensor")
    check_engine_in_cells(small)
    check_run(cfg)
    odd_heads = dataclasses.replace(cfg.model, num_attention_heads=36, num_query_groups=4, head_dim=128)
    with pytest.raises(ConfigValueError, match=r"engine.tp_size=8: does not divide model.num_attention_heads=36"):
        check_run(dataclasses.replace(cfg, model=odd_heads))
    with pytest.raises(ConfigValueError, match=r"engine.pp_size=2: exceeds model.num_layers=1: a stage without"):
        check_run(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=1)))
    with pytest.raises(ConfigValueError, match=r"train.tensor_parallel=8: must divide model.vocab_size=151937"):
        check_run(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=151937)))


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["slurm_gpu", "slurm_gpu_small"])
def test_gpu_presets_plan_one_sglang_server_over_each_cells_gpus(preset, tmp_path):
    """What SGLang's parser reads from the presets' command lines: slurm_gpu's cell of 2 nodes x 8 GPUs is one
    server of TP 8 x PP 2 over both nodes, fed from checkpoints (SGLang 0.5.23 gives an update group's engine
    ranks rank_offset + tp_rank, so a server with --pp-size > 1 could not join one weight broadcast group)."""
    from gyre.config.load import compose

    cfg = compose([f"cluster={preset}"])
    nodes = ["n0", "n1"][: cfg.cluster.core.nodes]
    plan = plan_servers("/models/qwen3", cfg.engine, cfg.model, nodes, cfg.cluster.core.gpus_per_node,
                        key_dir=tmp_path)  # fmt: skip
    got = [(p.node, p.node_rank, parsed(p.argv)) for p in plan]
    if preset == "slurm_gpu":  # the trainer's shape: TP 8 inside a node, a pipeline stage per node
        assert [(n, r, ns.tp_size, ns.pp_size, ns.nnodes, ns.node_rank, ns.dist_init_addr) for n, r, ns in got] == [
            ("n0", 0, 8, 2, 2, 0, "n0:30050"), ("n1", 1, 8, 2, 2, 1, "n0:30050")]  # fmt: skip
    else:
        assert [(n, ns.tp_size, ns.pp_size, ns.nnodes, ns.base_gpu_id) for n, _, ns in got] == [("n0", 8, 1, 1, 0)]
    assert all(ns.enable_memory_saver and ns.dp_size == 1 for _, _, ns in got)


@pytest.mark.integration
def test_role_switch_and_distributed_weights_through_the_engine_interface(fake_sglang, tmp_path):
    url, record = fake_sglang
    if torch.cuda.is_available():
        pytest.skip("the weight group is on the trainer's backend: NCCL on a CUDA machine, gloo in CI")
    setup = EngineSetup(SHAPES["qwen3-tiny"], None, tmp_path, tmp_path / "scratch")
    engine = make_engine(EngineConfig(backend="sglang", tp_size=1), setup)
    assert isinstance(engine, SGLangEngine) and engine.weight_sync == "distributed"
    engine.servers = EngineServers([url])  # as start() leaves it, with the server already up
    state = random_hf_state(SHAPES["qwen3-tiny"], seed=3, dtype=torch.float32)
    leave_rollout(engine, pause_mode="abort")
    join_rollout(engine, lambda: engine.update_weights(state, "4"))
    # a new version while serving: SGLang refuses it under running requests (it flushes its cache only when
    # idle), so they are retracted first; the group is opened once, reused
    update_while_serving(engine, lambda: engine.update_weights({k: v * 2 for k, v in state.items()}, "5"))
    info = SyncEngineClient(url).server_info()
    expected = sum(float(t.double().sum()) for t in state.values()) * 3
    assert info["weight_version"] == "5" and engine.version == "5"
    assert abs(info["received_sum"] - expected) < 1e-2 * max(1.0, abs(expected))
    sent = [json.loads(line) for line in record.read_text().splitlines()]
    order = [r["path"] for r in sent if r["path"] not in ("/health", "/get_server_info")]
    assert order == ["/pause_generation", "/release_memory_occupation", "/resume_memory_occupation",
                     "/init_weights_update_group", "/begin_weight_update", "/update_weights_from_distributed",
                     "/end_weight_update", "/resume_memory_occupation", "/continue_generation", "/pause_generation",
                     "/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update",
                     "/continue_generation"]  # fmt: skip
    for r in sent:
        if r["body"] is not None and r["path"] != "/health":
            parse_like_sglang(r["path"], r["body"])
    updates = [parse_like_sglang(r["path"], r["body"]) for r in sent if r["path"] == "/update_weights_from_distributed"]
    assert [u.weight_version for u in updates] == ["4", "5"] and updates[0].names == list(state)
    group = parse_like_sglang("/init_weights_update_group", next(r["body"] for r in sent if "init" in r["path"]))
    assert (group.rank_offset, group.world_size, group.backend) == (1, 2, "gloo")
    pauses = [r["body"]["mode"] for r in sent if r["path"] == "/pause_generation"]
    assert pauses == ["abort", "retract"]  # leaving rollout, then the update while serving
    resumes = [r["body"].get("tags") for r in sent if r["path"] == "/resume_memory_occupation"]
    assert resumes == [["weights"], ["kv_cache"]]
    check_stage_sender(url, record, len(sent), info["received_sum"])


def check_stage_sender(url, record, seen: int, received: float) -> None:
    """Shard to shard: a pipeline stage's sender (the one stage of a one-rank trainer here) names its megatron
    shard as HF does and broadcasts it in flattened buckets over a group of its own with the server."""
    from gyre.model.weights import hf_to_megatron
    from gyre.train.megatron_gpt import init_megatron_single_process

    init_megatron_single_process()
    untied = dataclasses.replace(SHAPES["qwen3-tiny"], tie_embeddings=False)
    hf = random_hf_state(untied, seed=4, dtype=torch.float32)
    megatron = hf_to_megatron(hf, untied)

    class Stage(torch.nn.Module):
        def state_dict(self):
            return megatron

    groups = {}
    client = SyncEngineClient(url)
    with pytest.raises(EngineError, match="must run between begin_weight_update"):  # as SGLang 0.5.23 answers
        client.update_weights_from_distributed(["w"], ["float32"], [[1]], "6", group_name="gyre_weights_0_stage0")
    seen = len(record.read_text().splitlines())
    with sglang_backend.weight_update_session([client]):  # a cell's leader holds it open while its ranks send
        sent = sglang_backend.send_stage(Stage(), untied, [client], "6", "127.0.0.1", 1, groups, backend="gloo",
                                         bucket_bytes=1 << 16)  # fmt: skip
    assert sent == len(hf) and list(groups) == ["gyre_weights_0_stage0"]
    new = [json.loads(line) for line in record.read_text().splitlines()][seen:]
    buckets = [parse_like_sglang(r["path"], r["body"]) for r in new if r["path"] == "/update_weights_from_distributed"]
    assert len(buckets) > 1 and {(b.load_format, b.group_name) for b in buckets} == {
        ("flattened_bucket", "gyre_weights_0_stage0")}  # fmt: skip
    assert sorted(n for b in buckets for n in b.names) == sorted(hf)
    info = SyncEngineClient(url).server_info()
    expected = received + sum(float(t.double().sum()) for t in hf.values())
    assert info["weight_version"] == "6" and abs(info["received_sum"] - expected) < 1e-2 * max(1.0, abs(expected))


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


@pytest.mark.integration
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_cell_of_two_ranks_sends_its_stages_to_sglang_shard_to_shard(fake_sglang, tmp_path, tp, pp):
    """The cell runtime's shard-to-shard update (tests/cell_weights_job.py, under mpirun): each rank of a cell of
    two sends what it holds, the server receives with SGLang's own code, and what it took is the model's whole
    HF state under transformers' Qwen3 names, each tensor once per version, over groups opened once."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    import cell_weights_job as job

    url, record = fake_sglang
    hf_dir = tmp_path / "qwen3"
    create_random_model(hf_dir, job.model_config(), seed=7, dtype=torch.float32)
    out = tmp_path / "out.pt"
    mpirun = Path(sys.executable).parent / "mpirun"
    proc = subprocess.run(
        [str(mpirun), "-n", "3", sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "cell_weights_job.py"),
         str(hf_dir), url, str(out), str(tp), str(pp)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    received = torch.load(out.with_suffix(".received.pt"), weights_only=False)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    assert type(reference).__name__ == "Qwen3ForCausalLM"
    assert set(received) == set(got["weights"]) == set(reference.state_dict())
    for name, tensor in got["weights"].items():  # the second version: the warm start's weights doubled
        assert torch.equal(received[name], tensor), name
    first = {k: v for f in hf_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    assert all(torch.equal(2 * first[k], received[k]) for k in first)
    n = len(first)
    senders = [[s for s in sent if s] for sent in got["sent"]]  # tensors each sending rank sent, per version
    if tp == 2:  # one sender: the stage's first tensor-parallel rank, with the gathered stage
        assert senders == [[n], [n]]
    else:  # one sender per stage, each with its own part of the model
        assert all(len(s) == 2 and 0 < min(s) and sum(s) == n for s in senders), senders
    assert got["engine_version"] == "2"
    stages = ["gyre_weights_0_stage0"] if pp == 1 else ["gyre_weights_0_stage0", "gyre_weights_0_stage1"]
    requests = [json.loads(line) for line in record.read_text().splitlines()]
    groups = [parse_like_sglang(r["path"], r["body"]) for r in requests if r["path"] == "/init_weights_update_group"]
    assert sorted(g.group_name for g in groups) == stages and {g.backend for g in groups} == {"gloo"}
    updates = [parse_like_sglang(r["path"], r["body"]) for r in requests if "update_weights" in r["path"]]
    assert {u.weight_version for u in updates} == {"1", "2"} and {u.group_name for u in updates} == set(stages)
    sessions = [r["path"] for r in requests if r["path"].endswith("_weight_update")]
    assert sessions == ["/begin_weight_update", "/end_weight_update"] * 2
