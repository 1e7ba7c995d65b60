"""A stand-in for an SGLang server's control side, for tests of gyre's SGLang engine on CPU: it answers
SGLang's routes, records each request body (one JSON line per request, to argv[2]), and receives weight
broadcasts the way SGLang's TP ranks do (SGLang's own init_custom_process_group and FlattenedTensorBucket,
gloo on CPU). As SGLang 0.5.23's SchedulerWeightUpdaterManager, it loads broadcast weights only inside a
weight-update session (/begin_weight_update ... /end_weight_update). POST /gyre_test/received {"path": P}
saves every tensor received so far, by name, to P (torch.save): a test's view of what the engine took.

    python tests/fake_sglang_server.py <port> <record.jsonl>
"""

import asyncio
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from aiohttp import web

sys.path.insert(0, str(Path(__file__).parent))
from sglang_io import light_common, sglang_root  # noqa: E402

RECORD = Path(sys.argv[2])
state = {"weight_version": "0", "groups": {}, "received_sum": 0.0, "received": {}, "session": False}


def record(path: str, body: object) -> None:
    with RECORD.open("a") as f:
        f.write(json.dumps({"path": path, "body": body}) + "\n")


def join_group(body: dict) -> None:
    group = light_common().init_custom_process_group(
        backend="gloo", init_method=f"tcp://{body['master_address']}:{body['master_port']}",
        world_size=body["world_size"], rank=body["rank_offset"], group_name=body["group_name"],
    )  # fmt: skip
    state["groups"][body["group_name"]] = group


def flattened_bucket_class() -> type:
    """SGLang's own FlattenedTensorBucket (sglang/srt/weight_sync/tensor_bucket.py imports only torch)."""
    path = sglang_root() / "srt" / "weight_sync" / "tensor_bucket.py"
    spec = importlib.util.spec_from_file_location("sglang_tensor_bucket", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FlattenedTensorBucket


def receive(body: dict) -> float:
    group = state["groups"][body["group_name"]]
    if body.get("load_format") == "flattened_bucket":  # as SGLang's _receive_bucketed_weights_from_distributed
        bucket = flattened_bucket_class().empty(body["names"], body["dtypes"], body["shapes"], "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
        tensors = bucket.reconstruct_tensors()
    else:
        tensors = []
        for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            torch.distributed.broadcast(t, src=0, group=group)
            tensors.append((name, t))
    state["received"].update((name, t.clone()) for name, t in tensors)
    return sum(float(t.double().sum()) for _, t in tensors)


def session(path: str) -> str | None:
    """SGLang's answer to a weight update outside a session, or to a session opened twice or closed unopened."""
    if path == "/begin_weight_update":
        opened, state["session"] = state["session"], True
        return "a weight-update session is already open; call end_weight_update() first" if opened else None
    if path == "/end_weight_update":
        opened, state["session"] = state["session"], False
        return None if opened else "no weight-update session is open; call begin_weight_update() first"
    if path in ("/update_weights_from_distributed", "/update_weights_from_tensor") and not state["session"]:
        return f"{path[1:]} must run between begin_weight_update() and end_weight_update()"
    return None


async def handle(request: web.Request) -> web.Response:
    raw = await request.read()
    body = json.loads(raw) if raw.strip() else None
    record(request.path, body)
    if refused := session(request.path):
        return web.json_response({"success": False, "message": refused}, status=400)
    if request.path == "/init_weights_update_group":
        await asyncio.to_thread(join_group, body)
        return web.json_response({"success": True, "message": "ok"})
    if request.path == "/update_weights_from_distributed":
        state["received_sum"] += await asyncio.to_thread(receive, body)
        state["weight_version"] = body["weight_version"]
        return web.json_response({"success": True, "message": "ok"})
    if request.path == "/gyre_test/received":
        torch.save(state["received"], body["path"])
        return web.json_response({"success": True, "names": len(state["received"])})
    if request.path == "/get_server_info":
        return web.json_response({"weight_version": state["weight_version"], "received_sum": state["received_sum"]})
    if request.path == "/shutdown":
        os._exit(0)  # as SGLang's processes end: killed, not torn down (gloo's destructors abort now and then)
    return web.json_response({"status": "ok"}) if request.method == "POST" else web.Response(status=200)


app = web.Application()
app.router.add_route("*", "/{tail:.*}", handle)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=lambda *_: print("READY", flush=True))
