"""Start and stop an embedded engine server as a subprocess in its own process group, tied to this process
(gyre.lifetime: it dies with it).

engine = start_engine(model_dir, num_threads=1)
... EngineClient(engine.url) ...
engine.stop()

The cell runtime and the colocate loop reach it through gyre.engine.embedded.EmbeddedEngine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gyre.config.schema import EngineConfig
from gyre.engine.admin_key import key_pipe
from gyre.lifetime import spawn_tied

READY_PREFIX = "GYRE_ENGINE_READY"  # the server prints "GYRE_ENGINE_READY <url>" once it serves


class EngineStartError(RuntimeError):
    """The engine process died or did not become healthy in time."""


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


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
    log_path = _log_path(log_path)
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
    engine = _spawn_engine(cmd, child_env, log_path, str(model_path))
    engine.temp_log = temp_log
    return _wait_until_healthy(engine, startup_timeout_s)


def _log_path(log_path: str | Path | None) -> Path:
    """`log_path` with its directory made, or a fresh temp file."""
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="gyre-engine-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return log_path


def _spawn_engine(cmd: list[str], env: dict[str, str], log_path: Path, model_path: str) -> EngineProcess:
    """Start the server, its output to `log_path`, the run's admin key through a pipe (never in its environment or
    command line); it dies with this process, even SIGKILLed: no engine outlives a crashed run."""
    log_file = open(log_path, "w")  # noqa: SIM115 - owned by the EngineProcess
    key_fd = key_pipe()
    try:
        proc = spawn_tied(
            [*cmd, f"--admin-key-fd={key_fd}"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            pass_fds=(key_fd,),
        )
    finally:
        os.close(key_fd)
    return EngineProcess(proc, "", log_path, model_path, log_file)


def _wait_until_healthy(engine: EngineProcess, timeout_s: float) -> EngineProcess:
    """The engine once it printed its URL and /health answers; stopped, with its log's tail in the error (the log
    then kept), if it exits or is not healthy within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.alive():
            engine.temp_log = False  # the error names the log
            engine.stop()
            raise EngineStartError(
                f"engine for {engine.model_path} exited with code {engine.proc.returncode} before it was ready; "
                f"log {engine.log_path}:\n{_tail(engine.log_path)}"
            )
        engine.url = engine.url or (_ready_url(engine.log_path) or "")
        if engine.url and _healthy(engine.url):
            return engine
        time.sleep(0.1)
    engine.temp_log = False  # the error names the log
    engine.stop()
    raise EngineStartError(
        f"engine for {engine.model_path} not healthy after {timeout_s:.0f}s (raise startup_timeout_s if the "
        f"machine is busy); log {engine.log_path}:\n{_tail(engine.log_path)}"
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
