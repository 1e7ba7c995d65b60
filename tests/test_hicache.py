"""KV kept on reroute through SGLang's HiCache over a Mooncake store (gyre/engine/hicache.py): the store's
master that a run starts (the mooncake-transfer-engine wheel's own mooncake_master, on loopback here), what a
clear does to it (the store client SGLang's MooncakeStore wraps, calling remove_all as SGLang's clear does),
that the master dies with the run, the clear request against SGLang's route, and its order after every cell
took a new version (the controller's TrainPlane.take_new_version)."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from sglang_io import sglang_root, sglang_routes

from gyre.comm.messages import Ack
from gyre.config.schema import EngineConfig, RunConfig
from gyre.engine.client import SyncEngineClient
from gyre.engine.hicache import master_command, start_master
from gyre.sched.controller.cell_table import Cell, CellTable
from gyre.sched.controller.train_plane import TrainPlane

ROOT = Path(__file__).resolve().parents[1]
CLEAR_ROUTE = "/hicache/storage-backend/clear"
STORE = "srt/mem_cache/storage/mooncake_store/mooncake_store.py"


@pytest.mark.unit
def test_the_clear_is_sglangs_route_and_empties_the_whole_store():
    assert "POST" in sglang_routes()[CLEAR_ROUTE]
    tree = ast.parse((sglang_root() / STORE).read_text())
    store = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MooncakeStore")
    clear = next(n for n in store.body if isinstance(n, ast.FunctionDef) and n.name == "clear")
    assert ast.unparse(clear.body) == "self.store.remove_all()"


@pytest.mark.unit
def test_the_master_is_the_wheels_binary_bound_to_the_runs_address():
    cmd = master_command("10.0.0.1", 41000, 41001)
    assert cmd[:3] == [sys.executable, "-m", "mooncake.cli"]
    assert cmd[3:] == ["--rpc_address=10.0.0.1", "--rpc_port=41000", "--metrics_host=10.0.0.1", "--metrics_port=41001"]


@pytest.mark.integration
def test_a_master_on_loopback_serves_the_store_sglang_uses_and_a_clear_empties_it(tmp_path):
    """SGLang's MooncakeStore is a mooncake.store.MooncakeDistributedStore set up with the extra config's
    master_server_address; its clear is remove_all. An object read within the master's default_kv_lease_ttl
    (10 s) is leased and survives remove_all: what docs/gpu.md says a clear leaves."""
    from mooncake.store import MooncakeDistributedStore

    master = start_master("127.0.0.1", tmp_path / "mooncake_master.log")
    store = MooncakeDistributedStore()
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master.address) == 0
        assert store.put("page-a", b"kv of version 1") == 0 and store.put("page-b", b"kv of version 1") == 0
        assert store.get("page-b") == b"kv of version 1"  # read: leased for default_kv_lease_ttl
        assert store.remove_all() == 1
        assert (store.is_exist("page-a"), store.is_exist("page-b")) == (0, 1)
    finally:
        store.close()
        master.stop()
    assert not master.alive()


@pytest.mark.integration
def test_the_master_ends_with_the_process_that_started_it(tmp_path):
    started = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\nfrom gyre.engine.hicache import start_master\n"
         f"m = start_master('127.0.0.1', Path({str(tmp_path / 'm.log')!r}))\nprint(m.process.pid, flush=True)\n"
         "time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    pid = int(started.stdout.readline())
    os.kill(pid, 0)  # running
    started.send_signal(signal.SIGKILL)  # the run dies without cleaning up
    started.wait(30)
    deadline = time.monotonic() + 30
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(pid)


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


class CellsTakeTheVersion:
    """The cells' side of sync_weights, done for real against each cell's engine: each loads the version."""

    def __init__(self) -> None:
        self.calls = 0

    def call(self, msgs, on_ack, dead):
        self.calls += 1
        for rank, msg in msgs.items():
            SyncEngineClient(URLS[rank]).update_weight_version(msg.version)
        return {rank: Ack(0, rank, {"pulled_bytes": []}) for rank in msgs}


URLS: dict[int, str] = {}


@pytest.mark.integration
def test_the_store_is_cleared_after_every_cell_took_the_version_through_each_engine(fake_sglang_pair):
    from sglang_io import parse_like_sglang

    (url0, record0), (url1, record1) = fake_sglang_pair
    URLS.update({1: url0, 2: url1})
    engine = EngineConfig(backend="sglang", enable_hierarchical_cache=True, hicache_storage_backend="mooncake")
    table = CellTable([Cell(0, 1, engine_url=url0), Cell(1, 2, role="train", engine_url=url1)])
    ctx = SimpleNamespace(cfg=RunConfig(engine=engine), table=table, outbox=CellsTakeTheVersion(), out=Path("."))
    plane = TrainPlane(ctx, book=None, faults=None, on_death=lambda ranks: None)  # type: ignore[arg-type]
    plane.version = 3
    acks = plane.take_new_version()
    assert sorted(acks) == [1, 2]
    for record in (record0, record1):
        sent = [json.loads(line) for line in record.read_text().splitlines()]
        paths = [r["path"] for r in sent if r["path"] not in ("/health", "/get_server_info")]
        assert paths == ["/update_weight_version", CLEAR_ROUTE]  # the version first, then the clear
        parse_like_sglang(paths[0], sent[-2]["body"])
    ctx.cfg = RunConfig(engine=EngineConfig(backend="sglang"))  # no shared store: nothing to clear
    plane.cfg = ctx.cfg
    plane.take_new_version()
    for record in (record0, record1):
        paths = [json.loads(line)["path"] for line in record.read_text().splitlines()]
        assert paths[-1] == "/update_weight_version" and paths.count(CLEAR_ROUTE) == 1
