"""The first process inside a sandbox: limits, the proxy relay, then the harness. Standard library only.

    python -I -S inside.py --fsize BYTES --nofile N --nproc N [--relay PORT:SOCKET] [--started FD] -- ARGV...

It sets the rlimits (inherited by everything the harness starts), listens on 127.0.0.1:PORT (the
sandbox's own loopback; the network namespace has nothing else) and relays each connection to the
Unix socket SOCKET, the rollout's one way out; writes "started" to FD (a pipe to the runner, closed
before the harness runs, so only this process can say the sandbox came up); then runs ARGV and exits
with its status. When it exits, the sandbox's PID namespace ends and every process the harness
started (setsid or not) is killed by the kernel.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import threading

BUFFER = 1 << 16


def _pipe(src: socket.socket, dst: socket.socket) -> None:
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


def _relay(listener: socket.socket, path: str) -> None:
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX)
        try:
            upstream.connect(path)
        except OSError:
            client.close()
            upstream.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _limit(which: int, value: int) -> None:
    if value > 0:
        resource.setrlimit(which, (value, value))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--fsize", type=int, default=0)
    p.add_argument("--nofile", type=int, default=0)
    p.add_argument("--nproc", type=int, default=0)
    p.add_argument("--relay", default="")
    p.add_argument("--started", type=int, default=-1)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    _limit(resource.RLIMIT_FSIZE, args.fsize)
    _limit(resource.RLIMIT_NOFILE, args.nofile)
    _limit(resource.RLIMIT_NPROC, args.nproc)
    if args.relay:
        port, path = args.relay.split(":", 1)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(port)))
        listener.listen(64)
        threading.Thread(target=_relay, args=(listener, path), daemon=True).start()
    if args.started >= 0:
        os.write(args.started, b"started\n")
        os.close(args.started)
    try:
        proc = subprocess.Popen(command)  # close_fds: the harness inherits only stdin/out/err
    except OSError as e:
        print(f"gyre sandbox: cannot start {command[:1]}: {e}", file=sys.stderr)
        return 127
    return proc.wait()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.exit(code if code >= 0 else 128 - code)
