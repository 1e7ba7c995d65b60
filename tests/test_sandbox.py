"""Sandbox command lines (golden), their config, rollout keys at the proxy, copying a workspace for
grading, and who a failure is attributed to. The attacks themselves: tests/test_red_team.py."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import anthropic
import openai
import pytest

from gyre.config.schema import ProxyConfig, SandboxConfig
from gyre.config.validate import ConfigValueError
from gyre.harness import endpoint
from gyre.harness.attribution import harness_failure
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog
from gyre.proxy.keys import RolloutKeys
from gyre.proxy.server import ProxyServer
from gyre.sandbox import (
    ApptainerSandbox,
    BwrapSandbox,
    Mount,
    SandboxJob,
    SandboxUnavailable,
    backends,
    make_sandbox,
    seccomp,
)
from gyre.sandbox.base import (
    GYRE_ROOT,
    INSIDE_SCRIPT,
    RELAY_PORT,
    SOCKET_PATH,
    SOURCE_ROOT,
    WORKSPACE,
    host_python,
    launcher_argv,
)
from gyre.tasks.grading import copy_workspace

PY = host_python()
LAUNCHER = [PY, "-I", "-S", "/opt/gyre/gyre/sandbox/inside.py", "--fsize", str(256 << 20), "--nofile", "1024",
            "--nproc", "4096", "--as", str(4096 << 20), "--seccomp", "--relay", "41000:/run/gyre/proxy.sock",
            "--connections", "64", "--watch", f"/workspace:{2048 << 20}", "--started", "5", "--"]  # fmt: skip


def job() -> SandboxJob:
    return SandboxJob(
        argv=[PY, "-m", "gyre.harness.builtin"], cwd="/workspace", env={"GYRE_API_KEY": "k"},
        mounts=[Mount(Path("/srv/ws"), "/workspace", writable=True), Mount(SOURCE_ROOT / "gyre", "/opt/gyre/gyre")],
        proxy_socket=Path("/tmp/ep/proxy.sock"), started_fd=5,
    )  # fmt: skip


@pytest.mark.unit
def test_bwrap_command_line(monkeypatch):
    monkeypatch.setattr(backends, "pids_prefix", lambda max_pids: [])  # a root run's pids cgroup: test_sandbox_limits
    sb = BwrapSandbox(SandboxConfig(), "bwrap")
    argv = sb.command(job())
    head = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--uid", "1000", "--gid", "1000",
            "--hostname", "sandbox"]  # fmt: skip
    assert argv[: len(head)] == head
    tail = ["--proc", "/proc", "--dev", "/dev", "--size", str(1024 << 20), "--tmpfs", "/tmp",
            "--size", str(512 << 20), "--tmpfs", "/home/agent", "--unshare-user", "--disable-userns", "--bind", "/srv/ws", "/workspace", "--ro-bind", str(SOURCE_ROOT / "gyre"), "/opt/gyre/gyre",
            "--bind", "/tmp/ep/proxy.sock", "/run/gyre/proxy.sock", "--remount-ro", "/", "--chdir", "/workspace",
            "--clearenv"]  # fmt: skip
    i = argv.index("--proc")
    assert argv[i : i + len(tail)] == tail
    system = argv[len(head) : i]  # only system directories and named /etc entries, never / or /etc or /root
    binds = [system[k + 1] for k in range(len(system)) if system[k] == "--ro-bind"]
    assert "/usr" in binds and all(b == "/usr" or b.startswith("/etc/") or b.startswith("/lib") for b in binds)
    assert "/etc/shadow" not in binds and "/" not in binds
    sets = {argv[k + 1]: argv[k + 2] for k in range(len(argv) - 2) if argv[k] == "--setenv"}
    assert sets["GYRE_API_KEY"] == "k" and sets["HOME"] == "/home/agent" and sets["PYTHONPATH"] == "/opt/gyre"
    assert set(sets) <= {"GYRE_API_KEY", "HOME", "PATH", "TMPDIR", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE",
                         "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM"}, sets  # fmt: skip
    assert argv[argv.index("--") + 1 :] == [*LAUNCHER, PY, "-m", "gyre.harness.builtin"]


@pytest.mark.unit
def test_apptainer_command_line(monkeypatch):
    monkeypatch.setattr(os, "environ", {"LANG": "C.UTF-8", "SLURM_JOB_ID": "7", "HF_TOKEN": "x"})
    sb = ApptainerSandbox(SandboxConfig(backend="apptainer", apptainer_image="/images/task.sif"), "apptainer")
    assert sb.command(job()) == [
        "apptainer", "exec", "--containall", "--no-home", "--cleanenv", "--net", "--network", "none",
        "--pwd", "/workspace",
        "--bind", "/srv/ws:/workspace:rw", "--bind", f"{SOURCE_ROOT / 'gyre'}:/opt/gyre/gyre:ro",
        "--bind", "/tmp/ep/proxy.sock:/run/gyre/proxy.sock",
        "--env", "LANG=C.UTF-8", "--env", "PATH=/usr/local/bin:/usr/bin:/bin", "--env", "TMPDIR=/tmp",
        "--env", "PYTHONPATH=/opt/gyre", "--env", "PYTHONDONTWRITEBYTECODE=1", "--env", "GYRE_API_KEY=k",
        "/images/task.sif", *LAUNCHER, PY, "-m", "gyre.harness.builtin",
    ]  # fmt: skip


@pytest.mark.unit
def test_sandbox_config_is_checked(monkeypatch):
    with pytest.raises(ConfigValueError, match="sandbox.backend='docker'"):
        SandboxConfig(backend="docker")
    with pytest.raises(ConfigValueError, match="apptainer_image"):
        SandboxConfig(backend="apptainer")
    with pytest.raises(ConfigValueError, match="sandbox.open_files"):
        SandboxConfig(open_files=0)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable, match="apptainer` is not on PATH"):
        make_sandbox(SandboxConfig(backend="apptainer", apptainer_image="/x.sif"))
    with pytest.raises(SandboxUnavailable, match="install bubblewrap"):
        make_sandbox(SandboxConfig())
    assert make_sandbox(SandboxConfig(backend="none")).isolated is False


@pytest.mark.unit
def test_workspace_copy_follows_no_link(tmp_path):
    src, outside = tmp_path / "ws", tmp_path / "outside"
    (src / "d").mkdir(parents=True)
    outside.mkdir()
    (outside / "secret").write_text("host file")
    (src / "d" / "a.txt").write_text("a")
    (src / "link_file").symlink_to(outside / "secret")
    (src / "link_dir").symlink_to(outside)
    os.mkfifo(src / "fifo")  # would block a reader: not copied
    copy_workspace(src, tmp_path / "copy")
    copy = tmp_path / "copy"
    assert (copy / "d" / "a.txt").read_text() == "a" and not (copy / "fifo").exists()
    assert os.readlink(copy / "link_file") == str(outside / "secret") and (copy / "link_dir").is_symlink()
    assert sorted(p.name for p in copy.rglob("*")) == ["a.txt", "d", "link_dir", "link_file"]


@pytest.mark.unit
def test_failure_attribution():
    ok = {"stop_reason": "finish", "turns": 2}
    common = {"started": True, "timed_out": False, "stderr_tail": "boom"}
    assert harness_failure(returncode=0, result=ok, endpoint_failures=[], **common) is None
    assert harness_failure(returncode=-9, result=None, endpoint_failures=[], started=True, timed_out=True,
                           stderr_tail="") is None  # timed out: the workspace is graded  # fmt: skip
    infra = harness_failure(returncode=1, result={"stop_reason": "api_error"}, endpoint_failures=["HTTP 503"], **common)
    assert (infra.status, infra.score) == ("failed", None) and "HTTP 503" in infra.reason
    lie = harness_failure(returncode=0, result={"stop_reason": "api_error"}, endpoint_failures=[], **common)
    assert (lie.status, lie.score) == ("agent_failed", 0.0) and lie.reason.startswith("harness_protocol:")
    crash = harness_failure(returncode=2, result=None, endpoint_failures=[], **common)
    assert crash.status == "agent_failed" and crash.reason.startswith("harness_exit:") and "boom" in crash.reason
    silent = harness_failure(returncode=0, result=None, endpoint_failures=[], **common)
    assert silent.status == "agent_failed" and silent.reason.startswith("harness_protocol:")
    down = harness_failure(returncode=1, result=None, endpoint_failures=[], started=False, timed_out=False,
                           stderr_tail="bwrap: No permissions")  # fmt: skip
    assert down.status == "failed" and "sandbox could not start: bwrap: No permissions" in down.reason
    # a context overflow: the harness's first request over the limit is the run's config (excluded, naming the
    # keys); once the policy has spoken, its grown context ends the rollout and the workspace is graded
    first = harness_failure(returncode=1, result={"stop_reason": "api_error"}, endpoint_failures=[],
                            context_overflows=["5000 > 4096"], overflow_before_any_answer=True, **common)  # fmt: skip
    assert first.status == "failed" and first.score is None and "proxy.max_context_tokens" in first.reason
    grown = {"returncode": 1, "result": {"stop_reason": "api_error"}, "context_overflows": ["5000 > 4096"]}
    assert harness_failure(endpoint_failures=[], **grown, **common) is None
    assert harness_failure(endpoint_failures=["HTTP 503"], **grown, **common).status == "failed"  # infra first


@pytest.mark.integration
def test_proxy_refuses_calls_without_their_rollouts_key(tmp_path):
    """Refusals happen before any engine is asked: no engine here."""
    keys = RolloutKeys()
    tok = Tokenizer.train(["hello world"] * 20, 280)
    proxy = ProxyServer(tok, [], ProxyConfig(), CallLog(), keys=keys)
    url = proxy.start()
    key = keys.issue("s0-g0-r0")
    messages = [{"role": "user", "content": "hi"}]
    try:
        for api_key, headers in [
            ("wrong", {}),
            ("none", {"X-Rollout-Id": "s0-g0-r0"}),
            (key, {"X-Rollout-Id": "s0-g0-r1"}),
        ]:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, default_headers=headers)
            with pytest.raises(openai.AuthenticationError) as err:
                client.chat.completions.create(model="m", messages=messages, max_tokens=2)
            assert err.value.body["code"] == "invalid_api_key" and err.value.body["type"] == "invalid_request_error"
        keys.revoke(key)
        client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as aerr:
            client.messages.create(model="m", messages=messages, max_tokens=2)
        body = aerr.value.body
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert "has ended" in body["error"]["message"]
    finally:
        proxy.stop()
    assert keys.live() == 0


def run_filter(program: list[tuple[int, int, int, int]], arch: int, nr: int, arg0: int = 0) -> int:
    """A classic-BPF interpreter for the few opcodes the filter uses, over one struct seccomp_data."""
    data = {seccomp.OFFSET_NR: nr, seccomp.OFFSET_ARCH: arch, seccomp.OFFSET_ARG0: arg0}
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == seccomp.RET_K:
            return k
        if code == seccomp.LD_W_ABS:
            acc, pc = data[k], pc + 1
            continue
        taken = {seccomp.JEQ_K: acc == k, seccomp.JGE_K: acc >= k, seccomp.JSET_K: bool(acc & k)}[code]
        pc += 1 + (jt if taken else jf)


@pytest.mark.unit
@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_seccomp_filter_decides_each_syscall(arch):
    """The hand-written jumps, on both architectures (only this machine's can be loaded here)."""
    prog, native = seccomp.program(arch), seccomp.AUDIT_ARCH[arch]
    eperm, enosys = seccomp.RET_ERRNO | 1, seccomp.RET_ERRNO | 38
    jumps = [(pc, jt, jf) for pc, (code, jt, jf, _) in enumerate(prog) if code not in (seccomp.RET_K, seccomp.LD_W_ABS)]
    assert all(0 <= jt < 256 and 0 <= jf < 256 and pc + 1 + max(jt, jf) < len(prog) for pc, jt, jf in jumps)
    for name, nr in seccomp.REFUSED[arch].items():
        assert run_filter(prog, native, nr) == eperm, name
    clone = seccomp.CLONE[arch]
    assert run_filter(prog, native, clone, 0x01200011) == seccomp.RET_ALLOW  # fork(): CLONE_CHILD_SETTID|... |SIGCHLD
    assert run_filter(prog, native, clone, 0x003D0F00) == seccomp.RET_ALLOW  # pthread_create's flags
    for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
        assert run_filter(prog, native, clone, flag | 17) == eperm, hex(flag)
    assert run_filter(prog, native, seccomp.CLONE3) == enosys
    for nr in (0, 1, 59, 221, 231, 260):  # read, write, execve, ... : allowed
        assert run_filter(prog, native, nr) == seccomp.RET_ALLOW
    assert run_filter(prog, 0x40000003, 1) == enosys  # i386 on x86_64: no second table
    assert run_filter(prog, native, seccomp.X32_SYSCALL_BIT | 1) == enosys  # x32
    assert len(seccomp.packed(arch)) == 8 * len(prog)


def _inside_module():
    spec = importlib.util.spec_from_file_location("gyre_inside", INSIDE_SCRIPT)
    inside = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(inside)
    return inside


@pytest.mark.unit
def test_the_launcher_reads_every_option_the_host_writes():
    """inside.py parses its options by hand (argparse alone cost each sandbox ~10 ms of CPU at start): what
    launcher_argv writes for a harness (relay, two watches, the start pipe) reads back whole, and an option it
    does not know stops it before anything runs."""
    inside = _inside_module()
    cfg = SandboxConfig()
    job = SandboxJob(argv=["python3", "-m", "x", "--flag", "--", "y"], cwd="/", proxy_socket=Path("/s"), started_fd=7,
                     mounts=[Mount(Path("/w"), WORKSPACE, writable=True)])  # fmt: skip
    argv = launcher_argv("python3", cfg, job)
    args = inside.Args(argv[argv.index(f"{GYRE_ROOT}/gyre/sandbox/inside.py") + 1 :])
    assert (args.fsize, args.nofile, args.nproc) == (cfg.file_size_mb << 20, cfg.open_files, cfg.processes)
    assert args.address_space == cfg.memory_mb << 20 and args.seccomp == cfg.seccomp and args.started == 7
    assert args.relay == f"{RELAY_PORT}:{SOCKET_PATH}" and args.connections == cfg.relay_connections
    assert args.watch == [f"{WORKSPACE}:{cfg.workspace_mb << 20}"]
    assert args.command == ["python3", "-m", "x", "--flag", "--", "y"]
    with pytest.raises(SystemExit, match="bad launcher option '--fsiz'"):
        inside.Args(["--fsiz", "1", "--", "true"])
    with pytest.raises(SystemExit, match="bad launcher option '--relay'"):
        inside.Args(["--relay"])


@pytest.mark.unit
def test_relay_and_endpoint_refuse_in_the_same_words():
    """inside.py (standard library only, in the sandbox, loaded here as the sandbox loads it) and the trainer's
    endpoint (which imports it) write the same 429 the SDKs read as an API error: a body in OpenAI's shape with
    Anthropic's `type: error`."""
    inside = _inside_module()
    response = inside.too_many_connections(64)
    assert response == endpoint.too_many_connections(64)
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 ") and f"Content-Length: {len(body)}".encode() in head
    error = json.loads(body)
    assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error"
    assert set(error["error"]) == {"message", "type", "param", "code"}


@pytest.mark.unit
def test_finished_sandboxes_cgroups_are_swept_at_most_once_every_few_seconds(tmp_path, monkeypatch):
    """A root run makes a pids cgroup per sandbox; the empty ones of finished sandboxes go, an old one still
    holding something and a young one (a sandbox being started) stay; and a run that makes hundreds of
    sandboxes a minute does not sweep at each (it took a controller 2 s of CPU in a 77 s run)."""
    from gyre.sandbox import limits

    old, busy, young = tmp_path / "old", tmp_path / "busy", tmp_path / "young"
    for d in (old, busy, young):
        d.mkdir()
    (busy / "cgroup.procs").write_text("123\n")
    for d in (old, busy):
        os.utime(d, (0, 0))
    (tmp_path / "cgroup.procs").write_text("")  # the parent's own files are not cgroups
    limits.sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "cgroup.procs", "young"]

    swept: list[Path] = []
    monkeypatch.setattr(limits, "pids_parent", lambda: tmp_path)
    monkeypatch.setattr(limits, "sweep", swept.append)
    monkeypatch.setattr(limits, "_last_sweep", -limits.SWEEP_EVERY_S)
    prefixes = [limits.pids_prefix(64) for _ in range(20)]
    assert swept == [tmp_path]  # once for twenty sandboxes
    assert all(p[:3] == ["/bin/sh", "-c", limits.ENTER] and p[3].endswith("/cgroup.procs") for p in prefixes)
    assert len({p[3] for p in prefixes}) == 20
    assert all(Path(p[3]).with_name("pids.max").read_text() == "64" for p in prefixes)
    monkeypatch.setattr(limits, "_last_sweep", limits._last_sweep - limits.SWEEP_EVERY_S)
    limits.pids_prefix(64)
    assert swept == [tmp_path, tmp_path]
