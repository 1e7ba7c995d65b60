"""The first process inside a sandbox: limits, the proxy relay, then the harness. Standard library only.

    python -I -S inside.py --fsize BYTES --nofile N --nproc N --as BYTES [--seccomp]
        [--relay PORT:SOCKET --connections N] [--watch DIR:BYTES] [--started FD] -- ARGV...

It sets the rlimits (inherited by everything the harness starts), loads the seccomp filter (seccomp.py
beside this file: no new namespaces, ptrace, mounts, keyrings, bpf, perf, modules), listens on
127.0.0.1:PORT (the sandbox's own loopback; the network namespace has nothing else) and relays each
connection to the Unix socket SOCKET, the rollout's one way out, at most N at once (beyond: an HTTP
429 in the API's JSON error shape, so one rollout cannot hold the trainer's descriptors); with --watch
DIR:BYTES, kills the harness (exit 137) once DIR (the workspace, a host directory) holds more; writes "started" to FD (a pipe to the runner, closed
before the harness runs, so only this process can say the sandbox came up); then runs ARGV and exits
with its status. When it exits, the sandbox's PID namespace ends and every process the harness
started (setsid or not) is killed by the kernel.
"""

from __future__ import annotations

import importlib.util
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

BUFFER = 1 << 16
THREAD_STACK = 256 << 10  # two relay threads per connection: small stacks keep them well inside RLIMIT_AS


def too_many_connections(cap: int) -> bytes:
    """The relay's refusal: HTTP 429 whose body both SDKs read as an API error (OpenAI's and Anthropic's shape)."""
    message = f"this rollout holds {cap} connections to the model API already (sandbox.relay_connections)"
    error = {"message": message, "type": "rate_limit_error", "param": None, "code": "too_many_connections"}
    import json  # only a refusal needs it: every sandbox starts this file, so its imports are kept few

    body = json.dumps({"type": "error", "error": error}).encode()
    head = f"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "Connection: close\r\n\r\n").encode() + body


class Relay:
    """Relays connections on `listener` to the Unix socket `path`, at most `cap` at once."""

    def __init__(self, listener: socket.socket, path: str, cap: int) -> None:
        self.listener, self.path, self.cap = listener, path, cap
        self.open = 0
        self.lock = threading.Lock()

    def serve(self) -> None:
        while True:
            client, _ = self.listener.accept()
            with self.lock:
                admitted = self.cap <= 0 or self.open < self.cap
                self.open += admitted
            if admitted:
                self._connect(client)
            else:
                self._refuse(client)

    def _connect(self, client: socket.socket) -> None:
        upstream = socket.socket(socket.AF_UNIX)
        try:
            upstream.connect(self.path)
        except OSError:
            client.close()
            upstream.close()
            self._closed()
            return
        ends = [2]
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(a, b, ends), daemon=True).start()

    def _refuse(self, client: socket.socket) -> None:
        try:
            client.recv(BUFFER, socket.MSG_DONTWAIT)  # what has arrived of the request: no reset on close
        except OSError:
            pass
        try:
            client.sendall(too_many_connections(self.cap))
        except OSError:
            pass
        client.close()

    def _pipe(self, src: socket.socket, dst: socket.socket, ends: list[int]) -> None:
        try:
            while data := src.recv(BUFFER):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        with self.lock:
            ends[0] -= 1
            if ends[0] == 0:  # both directions done: the connection is over
                src.close()
                dst.close()
                self.open -= 1

    def _closed(self) -> None:
        with self.lock:
            self.open -= 1


def allocated_bytes(root: str) -> int:
    """Bytes on disk under `root` (allocated blocks: a sparse file counts what it holds), links not followed."""
    total, stack = 0, [root]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                        if entry.is_dir(follow_symlinks=False):
                            stack.append(entry.path)
                    except OSError:
                        pass
        except OSError:
            pass
    return total


class Watch:
    """Kills the harness once the files under `root` take more than `limit` bytes (checked every second or so,
    less often for a tree that takes long to walk): a workspace is a host directory no mount can size."""

    def __init__(self, root: str, limit: int) -> None:
        self.root, self.limit = root, limit
        self.tripped = False

    def run(self, proc: subprocess.Popen[bytes]) -> None:
        while proc.poll() is None:
            start = time.monotonic()
            used = allocated_bytes(self.root)
            if used > self.limit:
                print(f"gyre sandbox: {self.root} holds {used >> 20} MiB, over its {self.limit >> 20} MiB "
                      "(sandbox.workspace_mb): harness killed", file=sys.stderr, flush=True)  # fmt: skip
                self.tripped = True
                proc.kill()
                return
            time.sleep(max(1.0, 10 * (time.monotonic() - start)))


def _load_seccomp() -> None:
    """Load the filter from seccomp.py beside this file (-I keeps this directory off sys.path)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seccomp.py")
    spec = importlib.util.spec_from_file_location("gyre_sandbox_seccomp", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()


def _limit(which: int, value: int) -> None:
    """Set a limit to `value`, or to the hard limit inherited when that is lower (it can only be lowered)."""
    if value > 0:
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


class Args:
    """The launcher's options (the module docstring's usage; gyre.sandbox.base.launcher_argv writes them)."""

    INTS = {"--fsize": "fsize", "--nofile": "nofile", "--nproc": "nproc", "--as": "address_space",
            "--connections": "connections", "--started": "started"}  # fmt: skip

    def __init__(self, argv: list[str]) -> None:
        self.fsize = self.nofile = self.nproc = self.address_space = self.connections = 0
        self.started = -1
        self.seccomp = False
        self.relay = ""
        self.watch: list[str] = []  # DIR:BYTES, repeatable: the workspace, the root's changes
        i = 0
        while i < len(argv) and argv[i] != "--":
            name = argv[i]
            if name == "--seccomp":
                self.seccomp, i = True, i + 1
                continue
            if i + 1 >= len(argv) or (name not in self.INTS and name not in ("--relay", "--watch")):
                raise SystemExit(f"gyre sandbox: bad launcher option {name!r} (usage: see gyre/sandbox/inside.py)")
            value = argv[i + 1]
            if name == "--relay":
                self.relay = value
            elif name == "--watch":
                self.watch.append(value)
            else:
                setattr(self, self.INTS[name], int(value))
            i += 2
        self.command = argv[i + 1 :]


def main(argv: list[str]) -> int:
    args = Args(argv)  # argparse alone would cost every sandbox ~10 ms of CPU at start
    command = args.command
    _limit(resource.RLIMIT_FSIZE, args.fsize)
    _limit(resource.RLIMIT_NOFILE, args.nofile)
    _limit(resource.RLIMIT_NPROC, args.nproc)
    _limit(resource.RLIMIT_AS, args.address_space)
    if args.seccomp:
        try:
            _load_seccomp()
        except OSError as e:  # never run the harness without the filter it was promised
            print(f"gyre sandbox: cannot load the seccomp filter: {e}", file=sys.stderr)
            return 126
    if args.relay:
        threading.stack_size(THREAD_STACK)
        port, path = args.relay.split(":", 1)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(port)))
        listener.listen(64)
        threading.Thread(target=Relay(listener, path, args.connections).serve, daemon=True).start()
    if args.started >= 0:
        os.write(args.started, b"started\n")
        os.close(args.started)
    try:
        proc = subprocess.Popen(command)  # close_fds: the harness inherits only stdin/out/err
    except OSError as e:
        print(f"gyre sandbox: cannot start {command[:1]}: {e}", file=sys.stderr)
        return 127
    watches = []
    for spec in args.watch:
        root, limit = spec.rsplit(":", 1)
        watches.append(Watch(root, int(limit)))
        threading.Thread(target=watches[-1].run, args=(proc,), daemon=True).start()
    code = proc.wait()
    return 128 + signal.SIGKILL if any(w.tripped for w in watches) else code  # killed for its limits


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.exit(code if code >= 0 else 128 - code)
