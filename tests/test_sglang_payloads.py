"""Every request gyre's engine client sends, and every SGLang command line it builds, checked against
SGLang's own definitions (`pip install --no-deps sglang`, loaded by tests/sglang_io.py).

Payloads are captured off the wire from the real EngineClient by a recording server on loopback, then
parsed as SGLang's FastAPI server parses them (pydantic over the io_struct classes), and more strictly:
a key the class lacks fails here, where SGLang would silently drop it.
"""

import asyncio
import base64
import dataclasses
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from sglang_io import (
    ENDPOINT_CLASS,
    light_common,
    load_auth,
    load_io_struct,
    load_sampling_params,
    parse_like_sglang,
    parse_server_argv,
    sglang_root,
    sglang_routes,
    sglang_version,
)

from gyre.config.schema import EngineConfig, ModelConfig, RunConfig
from gyre.config.validate import ConfigValueError, check_run
from gyre.engine.admin_key import admin_headers, take_run_admin_key
from gyre.engine.client import EngineClient, SamplingParams, SyncEngineClient
from gyre.engine.sglang_backend import sglang_launch_command, sglang_server_args
from gyre.engine.sglang_weights import (
    bind_weight_update_store,
    broadcast_state,
    distributed_metadata,
    open_weight_update_group,
    serialize_named_tensors,
)
from gyre.model.random_model import SHAPES, random_hf_state

pytestmark = pytest.mark.unit
SGLANG_VERSION = "0.5.23"  # keep in step with tools/setup_env.sh
ROOT = Path(__file__).resolve().parents[1]

NO_BODY = {"/flush_cache",  # SGLang reads only a `timeout` query parameter there
           "/hicache/storage-backend/clear"}  # its handler takes no body  # fmt: skip
GET_ONLY = {"/health", "/health_generate", "/get_server_info", "/get_model_info"}


def test_the_pinned_sglang_is_installed():
    assert sglang_version() == SGLANG_VERSION
    setup = (ROOT / "tools" / "setup_env.sh").read_text()
    assert f"SGLANG_VERSION={SGLANG_VERSION}\n" in setup and '--no-deps "sglang==$SGLANG_VERSION"' in setup


class Recorder:
    """A loopback server that answers like SGLang and keeps each request's method, path and body."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, object]] = []

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        self.requests.append((request.method, request.path, json.loads(raw) if raw.strip() else None))
        if request.path == "/generate":
            meta = {"id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
                    "weight_version": "7", "output_token_logprobs": [[-0.5, 11, None], [-0.25, 12, None]]}  # fmt: skip
            if json.loads(raw).get("return_sampling_mask"):  # SGLang's selected mode: one logprob per token
                meta |= {"output_token_sampling_mask": [[11], [12, 3]], "output_token_sampling_logprobs": [0.0, -0.1]}
            if json.loads(raw).get("return_routed_experts"):  # SGLang's answer: base64 of int32 (routed_experts.py)
                meta["routed_experts"] = base64.b64encode(np.arange(8, dtype=np.int32).tobytes()).decode()
            return web.json_response({"text": "", "output_ids": [11, 12], "meta_info": meta})
        if request.path == "/get_server_info":
            return web.json_response({"weight_version": "7"})
        if request.path.startswith(("/update_weight", "/init_weights", "/destroy_weights")):
            return web.json_response({"success": True, "message": "ok", "num_paused_requests": 0})
        return web.json_response({"status": "ok"}) if request.method == "POST" else web.Response(status=200)


async def call(result: object) -> object:
    """The answer of a call through either face: the async face returns a coroutine, the sync one the value."""
    return await result if inspect.isawaitable(result) else result


async def _drive_every_client_method(url: str, face: type = EngineClient) -> None:
    """Every call, through either face of the one client (the sync face blocks only its own thread's loop)."""
    client = face(url)
    state = random_hf_state(SHAPES["qwen3-tiny"], seed=0, dtype=torch.bfloat16)
    names, dtypes, shapes = distributed_metadata(state)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=2, stop_token_ids=[2], seed=5)
    try:
        res = await call(client.generate([1, 2, 3], params, rid="call-1"))
        assert res.output_ids == [11, 12] and res.output_logprobs == [-0.5, -0.25] and res.weight_version == "7"
        await call(client.generate([4, 5], SamplingParams()))
        truncated = SamplingParams(temperature=1.6, top_k=20, min_p=0.05, truncated_logprobs=True)
        assert (await call(client.generate([4, 5], truncated))).output_logprobs == [0.0, -0.1]
        routed = await call(client.generate([4, 5], SamplingParams(), routed_experts=True))
        assert routed.routed_experts.tolist() == list(range(8))
        await call(client.abort("call-1"))
        await call(client.abort(abort_all=True))
        for mode in ("in_place", "retract", "abort"):
            await call(client.pause_generation(mode))
        await call(client.continue_generation())
        await call(client.flush_cache())
        await call(client.release_memory())
        await call(client.release_memory(["kv_cache"]))
        await call(client.resume_memory(["weights"]))
        await call(client.resume_memory())
        await call(client.update_weights_from_disk("/ckpt/v3", "3"))
        await call(client.begin_weight_update())
        await call(client.end_weight_update())
        await call(client.clear_hicache_storage())
        await call(client.update_weights_from_tensor(serialize_named_tensors(list(state.items())[:2], tp_size=2), "4"))
        await call(client.init_weights_update_group("10.0.0.1", 29600, rank_offset=1, world_size=3))
        await call(client.update_weights_from_distributed(names, dtypes, shapes, "5"))
        await call(client.destroy_weights_update_group())
        await call(client.update_weight_version("6"))
        assert await call(client.health()) and await call(client.health_generate())
        await call(client.server_info())
        await call(client.model_info())
    finally:
        if hasattr(client, "close"):
            await client.close()


def _record(face: type) -> list[tuple[str, str, object]]:
    recorder = Recorder()

    async def run() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", recorder.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        try:
            drive = _drive_every_client_method(f"http://{host}:{port}", face)
            if face is EngineClient:
                await drive
            else:  # a blocking client in this loop would stall the recorder: drive it from another thread
                await asyncio.to_thread(asyncio.run, drive)
        finally:
            await runner.cleanup()

    asyncio.run(run())
    return recorder.requests


@pytest.fixture(scope="module")
def captured() -> list[tuple[str, str, object]]:
    return _record(EngineClient)


def test_the_sync_face_sends_exactly_what_the_async_face_sends(captured):
    def comparable(requests: list) -> list:  # CPU tensors pickle as file descriptors: their bytes differ per run
        return [(m, p, {**b, "serialized_named_tensors": len(b["serialized_named_tensors"])}
                 if p == "/update_weights_from_tensor" else b) for m, p, b in requests]  # fmt: skip

    assert comparable(_record(SyncEngineClient)) == comparable(captured)


def test_every_endpoint_the_client_uses_is_checked(captured):
    paths = {path for _, path, _ in captured}
    unchecked = paths - set(ENDPOINT_CLASS) - NO_BODY - GET_ONLY
    assert not unchecked, f"the client calls {unchecked}; add them to ENDPOINT_CLASS with their SGLang class"
    assert set(ENDPOINT_CLASS) <= paths, f"not exercised: {set(ENDPOINT_CLASS) - paths}"
    for method, path, _ in captured:
        assert (method == "GET") == (path in GET_ONLY), (method, path)


def test_every_route_the_client_calls_is_one_sglang_declares_with_that_method(captured):
    routes = sglang_routes()
    for method, path, _ in captured:
        assert method in routes.get(path, set()), f"SGLang 0.5.23's http_server.py has no {method} {path}"


def test_every_payload_parses_as_sglang_request(captured):
    for _, path, payload in captured:
        if path in ENDPOINT_CLASS:
            parse_like_sglang(path, payload)
        elif path in NO_BODY:
            assert not payload, f"{path} takes no body in SGLang, the client sent {payload}"


def test_generate_payload_normalizes_and_its_sampling_params_verify(captured):
    io = load_io_struct()
    SGLangSampling = load_sampling_params()
    bodies = [p for _, path, p in captured if path == "/generate"]
    for body in bodies:
        obj = parse_like_sglang("/generate", body)
        obj.normalize_batch_and_arguments()  # SGLang's own checks (input_ids vs text, batch shape, rid)
        assert isinstance(obj, io.GenerateReqInput) and obj.return_logprob is True and obj.stream is False
        params = SGLangSampling(**body["sampling_params"])  # unknown sampling keys raise TypeError
        params.normalize(None)
        params.verify(vocab_size=1000)
    routed = [parse_like_sglang("/generate", b) for b in bodies if "return_routed_experts" in b]
    assert len(routed) == 1 and routed[0].return_routed_experts is True and routed[0].routed_experts_start_len == 0
    masked = [parse_like_sglang("/generate", b) for b in bodies if b.get("return_sampling_mask")]
    assert len(masked) == 1 and masked[0].return_sampling_mask is True and masked[0].sampling_logprobs_mode is None
    assert (masked[0].sampling_params["top_k"], masked[0].sampling_params["min_p"]) == (20, 0.05)
    first = parse_like_sglang("/generate", bodies[0])
    assert first.rid == "call-1" and first.input_ids == [1, 2, 3]
    assert SGLangSampling(**bodies[0]["sampling_params"]).sampling_seed == 5


def test_control_payloads_carry_the_intended_values(captured):
    by_path: dict[str, list] = {}
    for _, path, payload in captured:
        if path in ENDPOINT_CLASS:
            by_path.setdefault(path, []).append(parse_like_sglang(path, payload))
    assert [p.mode for p in by_path["/pause_generation"]] == ["in_place", "retract", "abort"]
    aborts = by_path["/abort_request"]
    assert (aborts[0].rid, aborts[0].abort_all) == ("call-1", False) and aborts[1].abort_all is True
    assert [r.tags for r in by_path["/release_memory_occupation"]] == [None, ["kv_cache"]]
    assert [r.tags for r in by_path["/resume_memory_occupation"]] == [["weights"], None]
    disk = by_path["/update_weights_from_disk"][0]
    assert (disk.model_path, disk.weight_version, disk.abort_all_requests) == ("/ckpt/v3", "3", False)
    tensor = by_path["/update_weights_from_tensor"][0]
    assert tensor.weight_version == "4" and len(tensor.serialized_named_tensors) == 2  # one per TP rank
    assert all(isinstance(b, bytes) for b in tensor.serialized_named_tensors)  # base64 decoded by SGLang's schema
    group = by_path["/init_weights_update_group"][0]
    assert (group.master_port, group.rank_offset, group.world_size, group.backend) == (29600, 1, 3, "nccl")
    dist_req = by_path["/update_weights_from_distributed"][0]
    assert dist_req.weight_version == "5" and dist_req.dtypes[0] == "bfloat16" and len(dist_req.names) > 10
    assert by_path["/update_weight_version"][0].new_version == "6"
    assert by_path["/update_weight_version"][0].abort_all_requests is False  # SGLang's default would abort all


def test_unknown_or_missing_keys_are_caught():
    with pytest.raises(AssertionError, match=r"\['mode_typo'\] are not fields"):
        parse_like_sglang("/pause_generation", {"mode_typo": "in_place"})
    with pytest.raises(AssertionError, match="required fields .*model_path"):
        parse_like_sglang("/update_weights_from_disk", {"weight_version": "1"})
    with pytest.raises(Exception, match="mode"):
        parse_like_sglang("/pause_generation", {"mode": "sideways"})


def test_tensor_payload_deserializes_with_sglangs_unpickler():
    state = random_hf_state(SHAPES["qwen3-tiny"], seed=1, dtype=torch.bfloat16)
    payloads = serialize_named_tensors(state.items(), tp_size=2)
    common = light_common()
    for payload in payloads:  # what each TP rank's scheduler does with its entry
        named = common.MultiprocessingSerializer.deserialize(payload)
        assert [n for n, _ in named] == list(state)
        assert all(torch.equal(t, state[n]) and t.dtype == torch.bfloat16 for n, t in named)


def test_distributed_update_interoperates_with_sglangs_group_join(tmp_path):
    """Trainer rank 0 (gyre) and an engine rank (SGLang's init_custom_process_group, gloo on CPU)."""
    state = random_hf_state(SHAPES["qwen3-tiny"], seed=2, dtype=torch.float32)
    names, dtypes, shapes = distributed_metadata(state)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"names": names, "dtypes": dtypes, "shapes": shapes}))
    store = bind_weight_update_store("127.0.0.1", world_size=2, timeout_s=60)  # bound first: no port race
    port = store.port
    engine_side = textwrap.dedent(f"""
        import json, os, sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from sglang_io import light_common
        meta = json.load(open({str(meta)!r}))
        group = light_common().init_custom_process_group(
            backend="gloo", init_method="tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name="weight_update_group")
        total = 0.0
        for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"]):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(t, src=0, group=group)
            total += float(t.double().sum())
        print(f"SUM {{total:.6f}}", flush=True)
        torch.distributed.destroy_process_group(group)  # as SGLang's /destroy_weights_update_group does
        # torch's exit-time destructors abort now and then ("terminate called without an active
        # exception", no Python frame) once a gloo group has existed; SGLang's processes are killed
        # by their parent rather than torn down, so leave the same way
        os._exit(0)
    """)
    proc = subprocess.Popen([sys.executable, "-c", engine_side], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)  # fmt: skip
    try:
        group = open_weight_update_group("127.0.0.1", port, world_size=2, backend="gloo", timeout_s=60, store=store)
        broadcast_state(state, group)
        out, err = proc.communicate(timeout=120)
        torch.distributed.destroy_process_group(group)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    expected = sum(float(t.double().sum()) for t in state.values())
    assert abs(float(out.split("SUM")[1]) - expected) < 1e-3


# ----- server command lines -----


def test_hicache_over_a_mooncake_store_as_sglangs_parser_and_store_config_read_it():
    """The command-line side of KV kept on reroute (sched.kv_migration stays off on SGLang): a write policy, a
    prefetch policy and the store's address, in the keys SGLang's Mooncake store reads; the address of the
    master the run starts when the site names none."""
    import re

    extra = {"master_server_address": "n0:50051", "protocol": "rdma", "device_name": "mlx5_0",
             "metadata_server": "P2PHANDSHAKE", "global_segment_size": 4 << 30}  # fmt: skip
    cfg = EngineConfig(backend="sglang", enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                       hicache_write_policy="write_through", hicache_storage_prefetch_policy="wait_complete",
                       hicache_storage_extra_config=json.dumps(extra))  # fmt: skip
    ns, unknown = parse_server_argv(sglang_server_args("/m", cfg, 30000))
    assert not unknown and ns.enable_hierarchical_cache and ns.hicache_storage_backend == "mooncake"
    assert (ns.hicache_write_policy, ns.hicache_storage_prefetch_policy) == ("write_through", "wait_complete")
    assert json.loads(ns.hicache_storage_backend_extra_config) == extra
    store = (sglang_root() / "srt/mem_cache/storage/mooncake_store/mooncake_store.py").read_text()
    read = store[store.index("def load_from_extra_config") :]
    assert set(extra) <= set(re.findall(r'extra_config\.get\(\s*"(\w+)"', read))  # keys SGLang reads
    from gyre.engine.hicache import needs_master, with_master

    assert not needs_master(cfg)  # the site's master
    own = dataclasses.replace(cfg, hicache_storage_extra_config='{"protocol": "tcp"}')
    assert needs_master(own)  # none named: the run starts mooncake_master and adds its address
    ns, _ = parse_server_argv(sglang_server_args("/m", with_master(own, "10.0.0.1:41000"), 30000))
    assert json.loads(ns.hicache_storage_backend_extra_config) == {"master_server_address": "10.0.0.1:41000",
                                                                   "protocol": "tcp"}  # fmt: skip
    with pytest.raises(ConfigValueError, match="is not JSON"):
        dataclasses.replace(cfg, hicache_storage_extra_config="master=n0")
    assert "--hicache-write-policy" not in sglang_server_args("/m", EngineConfig(backend="sglang"), 30000)


SGLANG = EngineConfig(backend="sglang", tp_size=2, mem_fraction_static=0.7, dtype="bfloat16", port=30000,
                      enable_hierarchical_cache=True, hicache_storage_backend="mooncake", chunked_prefill_size=4096,
                      extra_args=["--schedule-policy", "lpm"])  # fmt: skip
QWEN3 = SHAPES["qwen3-0.6b"]


def test_server_args_parse_with_sglangs_own_parser():
    argv = sglang_server_args("/models/qwen3", SGLANG, 30001, QWEN3, weight_version="12", served_model_name="policy")
    ns, unknown = parse_server_argv(argv)
    assert not unknown, f"flags SGLang does not declare: {unknown}"
    assert ns.model_path == "/models/qwen3" and ns.port == 30001 and ns.host == "127.0.0.1"
    assert (ns.tp_size, ns.mem_fraction_static, ns.dtype, ns.load_format) == (2, 0.7, "bfloat16", "auto")
    assert ns.enable_memory_saver and not ns.enable_weights_cpu_backup and ns.weight_version == "12"
    assert ns.enable_hierarchical_cache and ns.hicache_storage_backend == "mooncake"
    assert (ns.context_length, ns.max_running_requests, ns.chunked_prefill_size) == (4096, 64, 4096)
    assert ns.served_model_name == "policy" and ns.schedule_policy == "lpm" and ns.random_seed == 0
    assert ns.admin_api_key == ns.api_key == take_run_admin_key()  # what every EngineClient sends
    assert take_run_admin_key() not in " ".join(argv)  # from the --config file (0600), not the command line
    config = Path(argv[argv.index("--config") + 1])
    assert config.stat().st_mode & 0o777 == 0o600


def test_the_run_admin_key_unlocks_exactly_sglangs_protected_routes():
    """SGLang's own auth decision (sglang/srt/utils/auth.py) with the keys our command line gives it."""
    auth = load_auth()
    key = take_run_admin_key()

    def allowed(path: str, level, header: str | None) -> bool:
        decision = auth.decide_request_auth(
            method="POST", path=path, authorization_header=header, api_key=key, admin_api_key=key, auth_level=level
        )
        return decision.allowed

    ours = admin_headers()["Authorization"]
    for path, level in [
        ("/update_weights_from_disk", auth.AuthLevel.ADMIN_OPTIONAL),
        ("/generate", auth.AuthLevel.NORMAL),
    ]:
        assert allowed(path, level, ours) and not allowed(path, level, None) and not allowed(path, level, "Bearer x")
    assert allowed("/health", auth.AuthLevel.NORMAL, None)  # probes need no key


def test_every_config_switch_maps_to_a_declared_flag():
    on = EngineConfig(backend="sglang", enable_weights_cpu_backup=True, disable_radix_cache=True,
                      enable_memory_saver=False, load_format="dummy", dtype="auto", log_level="debug")  # fmt: skip
    ns, unknown = parse_server_argv(sglang_server_args("/m", on, 1234, routed_experts=True))
    assert not unknown and ns.enable_weights_cpu_backup and ns.disable_radix_cache and not ns.enable_memory_saver
    assert ns.enable_return_routed_experts  # rl.routing_replay
    assert not parse_server_argv(sglang_server_args("/m", on, 1234))[0].enable_return_routed_experts
    assert ns.load_format == "dummy" and ns.log_level == "debug"
    assert sglang_launch_command("/m", on, 1234)[:3] == ["python", "-m", "sglang.launch_server"]


def test_server_args_reject_invalid_layouts_with_clear_errors():
    """Refused at the edge, before anything starts (check_run: launch.run), not by the engine's own code."""
    with pytest.raises(ConfigValueError, match=r"engine.tp_size=3: does not divide model.num_attention_heads=16"):
        check_run(RunConfig(engine=dataclasses.replace(SGLANG, tp_size=3), model=QWEN3))
    kv3 = dataclasses.replace(QWEN3, num_query_groups=4, num_attention_heads=12)
    with pytest.raises(ConfigValueError, match="neither divides nor is a multiple of model.num_query_groups=4"):
        check_run(RunConfig(engine=dataclasses.replace(SGLANG, tp_size=6), model=kv3))
    with pytest.raises(ValueError, match="engine.backend=sglang"):
        sglang_server_args("/m", EngineConfig(), 1)
    with pytest.raises(ConfigValueError, match="unknown engine backend"):
        EngineConfig(backend="vllm")
    with pytest.raises(ConfigValueError, match="mem_fraction_static"):
        EngineConfig(backend="sglang", mem_fraction_static=1.5)
    with pytest.raises(ConfigValueError, match="enable_hierarchical_cache"):
        EngineConfig(backend="sglang", hicache_storage_backend="mooncake")
    with pytest.raises(ConfigValueError, match="max_position_embeddings"):
        check_run(RunConfig(engine=dataclasses.replace(SGLANG, max_context_tokens=8192),
                            model=ModelConfig(num_attention_heads=4, max_position_embeddings=4096)))  # fmt: skip


def test_engine_preset_composes():
    from gyre.config.load import compose

    cfg = compose(["engine=sglang"])
    assert cfg.engine.backend == "sglang" and cfg.engine.enable_memory_saver
    assert not parse_server_argv(sglang_server_args("/m", cfg.engine, 30000, cfg.model))[1]
