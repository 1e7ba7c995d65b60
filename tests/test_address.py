"""The address story of a cell job (gyre/comm/address.py, gyre/sched/launch/job_preflight.py): what a rank
advertises is resolved on its own node, and addresses the other hosts cannot reach are refused before
anything starts, naming the key to set. Several hosts are simulated by their host identities; the
multi-host Slurm cluster runs the real thing (tests/test_slurm_cell_job.py, tests/test_slurm_multihost.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gyre.comm.address import AddressError, RankAddress, advertise_address, check_reachable, interface_of
from gyre.config.schema import RunConfig
from gyre.sched.launch import job_preflight
from gyre.sched.launch.job_preflight import PreflightError, run_preflight

pytestmark = pytest.mark.unit


def rank(r: int, address: str, host: str, local: bool = True) -> RankAddress:
    return RankAddress(r, f"cell {r - 1} on node{r}", address, host, f"node{r}", local)


def test_auto_and_names_resolve_to_addresses_here() -> None:
    assert advertise_address("127.0.0.1") == "127.0.0.1"
    assert advertise_address("localhost") == "127.0.0.1"
    assert advertise_address("auto", interface="lo") == "127.0.0.1"
    resolved = advertise_address("auto")
    assert resolved != "auto" and resolved.count(".") == 3
    assert interface_of("127.0.0.1") == "lo"
    with pytest.raises(AddressError, match="comm.interface='nope0'"):
        advertise_address("auto", interface="nope0")


def test_loopback_is_fine_on_one_host_and_refused_across_hosts() -> None:
    check_reachable([rank(0, "127.0.0.1", "h"), rank(1, "127.0.0.1", "h")], "auto", "127.0.0.1")
    debian = [rank(0, "10.200.0.11", "a"), rank(1, "10.200.0.11", "a"), rank(2, "127.0.1.1", "b")]
    with pytest.raises(AddressError) as info:
        check_reachable(debian, "auto", "0.0.0.0")
    text = str(info.value)
    assert "span 2 hosts" in text and "cell 1 on node2 (rank 2) would advertise 127.0.1.1" in text
    assert "127.0.1.1 node2" in text and "comm.interface" in text and "rank 0" not in text
    explicit = [rank(0, "127.0.0.1", "a"), rank(1, "127.0.0.1", "b")]
    with pytest.raises(AddressError, match=r"comm.hostname='127.0.0.1' is a loopback address; set comm.hostname=auto"):
        check_reachable(explicit, "127.0.0.1", "0.0.0.0")


def test_engines_on_loopback_one_address_for_many_hosts_and_foreign_addresses_are_refused() -> None:
    ok = [rank(0, "10.0.0.1", "a"), rank(1, "10.0.0.2", "b")]
    check_reachable(ok, "auto", "0.0.0.0")
    with pytest.raises(
        AddressError, match=r"engine.host='127.0.0.1' binds every engine to loopback.*engine.host=0.0.0.0"
    ):
        check_reachable(ok, "auto", "127.0.0.1")
    with pytest.raises(AddressError, match="2 hosts advertise the same address 10.0.0.1"):
        check_reachable([rank(0, "10.0.0.1", "a"), rank(1, "10.0.0.1", "b", local=False)], "10.0.0.1", "0.0.0.0")
    with pytest.raises(AddressError, match="10.9.9.9, which is not an address of its host node1"):
        check_reachable([rank(1, "10.9.9.9", "a", local=False)], "10.9.9.9", "0.0.0.0")


def test_gloo_refuses_an_unresolved_address() -> None:
    from gyre.comm.gloo_transport import init_gloo_from_mpi

    with pytest.raises(ValueError):
        init_gloo_from_mpi(None, "auto")


class ThreadWorld:
    """Ranks as threads: the collectives run_preflight uses."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size

    def rank(self, r: int) -> ThreadWorld.Rank:
        return ThreadWorld.Rank(self, r)

    class Rank:
        def __init__(self, world: ThreadWorld, r: int) -> None:
            self.world, self.r = world, r

        def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
            return self.r

        def Get_size(self) -> int:  # noqa: N802
            return self.world.size

        def Barrier(self) -> None:  # noqa: N802
            self.world.barrier.wait()

        def allgather(self, value: object) -> list:
            self.world.slots[self.r] = value
            self.world.barrier.wait()
            got = list(self.world.slots)
            self.world.barrier.wait()
            return got


def preflight_on(outs: list[Path], cfg: RunConfig) -> list[object]:
    world = ThreadWorld(len(outs))
    results: list[object] = [None] * len(outs)

    def one(r: int) -> None:
        try:
            results[r] = run_preflight(world.rank(r), cfg, outs[r], "start1")
        except PreflightError as e:
            results[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(outs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_preflight_resolves_once_and_finds_an_output_dir_that_is_not_shared(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(job_preflight, "SHARED_FS_WAIT_S", 0.5)
    cfg = RunConfig()
    cfg.comm.hostname = "auto"
    shared = tmp_path / "run"
    assert preflight_on([shared, shared, shared], cfg) == [advertise_address("auto")] * 3
    assert not (shared / ".preflight" / "start1").exists()  # the markers are cleaned up
    # rank 2 sees another directory at the output path (a node-local /tmp, say): every rank refuses
    results = preflight_on([shared, shared, tmp_path / "elsewhere"], cfg)
    assert all(isinstance(r, PreflightError) for r in results)
    assert "output_dir" in str(results[0]) and "does not see the files of" in str(results[0])
    assert "the controller on" in str(results[2]) and "['cell 1 on" in str(results[2])  # names who misses whom
    cfg.comm.transfer_backend = "gloo"
    results = preflight_on([shared, shared], cfg)
    assert all(isinstance(r, PreflightError) and "use comm.transfer_backend=mooncake" in str(r) for r in results)


def test_an_engine_is_reachable_once_it_answers_http_at_all() -> None:
    import http.server

    from gyre.comm.address import engine_reachable

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # 501s
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert engine_reachable(f"http://127.0.0.1:{server.server_address[1]}", 2.0) == ""
    finally:
        server.shutdown()
        server.server_close()
    assert "ConnectionRefusedError" in engine_reachable("http://127.0.0.1:1", 0.5)
