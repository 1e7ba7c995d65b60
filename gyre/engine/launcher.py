"""Start and stop an embedded engine server as a subprocess in its own process group.

engine = start_engine(model_dir, num_threads=1)
... EngineClient(engine.url) ...
engine.stop()

The cell runtime and the colocate loop reach it through gyre.engine.embedded.EmbeddedEngine.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre.config.schema import EngineConfig
from gyre.engine.admin_key import key_pipe

READY_PREFIX = "GYRE_ENGINE_READY"  # the server prints "GYRE_ENGINE_READY <url>" once it serves


class EngineStartError(RuntimeError):
    """The engine process died or did not become healthy in time."""


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started the engine dies, even by SIGKILL,
    so an engine never outlives its run (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing). Only for
    engines started from the main thread: the signal fires when the forking *thread* exits."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


@dataclass
class EngineProcess:
    proc: subprocess.Popen
    url: str
    log_path: Path
    model_path: str
    _log_file: object = field(default=None, repr=False)
    temp_log: bool = False  # the log is a temp file of ours: removed after a clean stop, kept after a failure

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the process group, then SIGKILL it if it has not exited within timeout_s."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)
            except ProcessLookupError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.temp_log and self.proc.returncode in (0, -signal.SIGTERM):
            self.log_path.unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _healthy(url: str) -> bool:
    from gyre.engine.client import SyncEngineClient

    return SyncEngineClient(url, timeout_s=2.0).health()


def _ready_url(log_path: Path) -> str | None:
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith(READY_PREFIX):
            return line.split()[1]
    return None


def start_engine(
    model_path: str | Path,
    port: int = 0,
    num_threads: int = 1,
    host: str = "127.0.0.1",
    max_running_requests: int = 64,
    max_context_tokens: int = 4096,
    prefix_cache_tokens: int | None = None,
    weight_version: str = "default",
    startup_timeout_s: float = 120.0,
    log_path: str | Path | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    weights_dirs: list[str | Path] | None = None,
) -> EngineProcess:
    """Launch `python -m gyre.engine.server` and wait until /health answers.

    The engine gets this run's admin key (gyre.engine.admin_key) through a pipe and loads new weights only from
    `weights_dirs` (default: `model_path`). Output (stdout and stderr) goes to log_path (a temp file by default); on failure the error
    carries its tail.
    """
    temp_log = log_path is None
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="gyre-engine-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "gyre.engine.server",
        f"--model-path={model_path}",
        f"--host={host}",
        f"--port={port}",
        f"--num-threads={num_threads}",
        f"--max-running-requests={max_running_requests}",
        f"--max-context-tokens={max_context_tokens}",
        f"--weight-version={weight_version}",
    ]
    if prefix_cache_tokens is not None:
        cmd.append(f"--prefix-cache-tokens={prefix_cache_tokens}")
    cmd += [f"--weights-dir={d}" for d in weights_dirs or []]
    cmd += list(extra_args or [])
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", str(num_threads))
    log_file = open(log_path, "w")  # noqa: SIM115 - owned by the EngineProcess
    key_fd = key_pipe()  # the admin key: in a pipe, never in the engine's environment or command line
    try:
        proc = subprocess.Popen(
            [*cmd, f"--admin-key-fd={key_fd}"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            start_new_session=True,
            pass_fds=(key_fd,),
            # the kernel ties PDEATHSIG to the thread that forks: only the main thread lives as long as the run
            preexec_fn=_die_with_parent if threading.current_thread() is threading.main_thread() else None,
        )
    finally:
        os.close(key_fd)
    engine = EngineProcess(proc, "", log_path, str(model_path), log_file, temp_log)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if not engine.alive():
            engine.temp_log = False  # the error names the log
            engine.stop()
            raise EngineStartError(
                f"engine for {model_path} exited with code {proc.returncode} before it was ready; "
                f"log {log_path}:\n{_tail(log_path)}"
            )
        engine.url = engine.url or (_ready_url(log_path) or "")
        if engine.url and _healthy(engine.url):
            return engine
        time.sleep(0.1)
    engine.temp_log = False  # the error names the log
    engine.stop()
    raise EngineStartError(
        f"engine for {model_path} not healthy after {startup_timeout_s:.0f}s (raise startup_timeout_s if the "
        f"machine is busy); log {log_path}:\n{_tail(log_path)}"
    )


def start_engine_from_config(model_path: str | Path, cfg: EngineConfig, **kwargs: object) -> EngineProcess:
    """start_engine with the fields of an EngineConfig (backend must be 'embedded')."""
    if cfg.backend != "embedded":
        raise ValueError(f"engine backend {cfg.backend!r} is not launched locally; only 'embedded' is")
    dtype = "float32" if cfg.dtype == "auto" else cfg.dtype
    kwargs["extra_args"] = ["--device", cfg.device, "--dtype", dtype, *kwargs.get("extra_args", [])]  # type: ignore[misc]
    return start_engine(
        model_path,
        port=cfg.port,
        num_threads=cfg.num_threads,
        host=cfg.host,
        max_running_requests=cfg.max_running_requests,
        max_context_tokens=cfg.max_context_tokens,
        startup_timeout_s=cfg.startup_timeout_s,
        **kwargs,
    )
