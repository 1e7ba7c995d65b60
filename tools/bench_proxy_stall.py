"""Can one bad request stall the proxy? Valid calls and /health latency while each bad body is refused.

    python -m tools.bench_proxy_stall --old-root /work/main     # before (another checkout) and after (this one)

starts one embedded engine (a tiny random model, context 4096), then for each checkout a proxy of its own
(a process, default config), and runs, beside a steady stream of valid small calls (OpenAI, one token, a
fresh connection each, rollout `good`) and /health probes (a fresh connection each, every 20 ms): a quiet
phase, then each bad body from another rollout (`bad`), sent again and again for at least `--window-s`:
a 5 MB assistant turn, a 5 MB tool description, 131K tiny messages, 60K tools, count_tokens of a 5 MB
message, and 1,044 idle connections held open. Reported per phase: p50/p99 of the valid calls and of
/health (answers other than 200 counted as errors), and how long the bad body took to be refused.
Loopback only; each bad body gives up after `--timeout-s`.

Measured on the 2-core dev machine shared with other sessions, 2026-12-02, old = main at 8b49e1b, new = the
proxy that refuses from lower bounds, works off the event loop and caps per rollout (ms: p50 / p99, answers
other than 200 in brackets; refusal: median seconds per bad body and its status). Load average ~4:

    | phase                 | proxy | valid calls        | /health            | bad body refused |
    |-----------------------|-------|--------------------|--------------------|------------------|
    | quiet                 | old   | 4 / 10             | 1 / 28             | -                |
    | quiet                 | new   | 4 / 13             | 1 / 8              | -                |
    | 5 MB assistant turn   | old   | 5037 / 5037        | 2514 / 5024        | 5.05 s (400)     |
    | 5 MB assistant turn   | new   | 17 / 80            | 8 / 49             | 0.06 s (400)     |
    | 5 MB tool description | old   | 47 / 5145          | 10 / 5131          | 5.23 s (400)     |
    | 5 MB tool description | new   | 13 / 55            | 4 / 23             | 0.05 s (400)     |
    | 131K tiny messages    | old   | 687 / 873          | 667 / 864          | 0.69 s (400)     |
    | 131K tiny messages    | new   | 4 / 11             | 1 / 5              | 0.06 s (400)     |
    | 60K tools             | old   | 44 / 2457          | 7 / 2419           | 4.84 s (400)     |
    | 60K tools             | new   | 4 / 15             | 1 / 10             | 0.30 s (400)     |
    | 5 MB count_tokens     | old   | 115 / 115          | 1833 / 3661        | 3.70 s (200)     |
    | 5 MB count_tokens     | new   | 7 / 16             | 2 / 10             | 0.02 s (400)     |
    | 1044 idle connections | old   | 4 / 10 (7 x 503)   | 1 / 1037 (2 x 503) | -                |
    | 1044 idle connections | new   | 4 / 9              | 1 / 31             | -                |

Under load average 10-12 (other sessions' test runs), the old proxy's stalls grew to 10-26 s per bad body
(health p99 9-19 s) and the new one's p99s were 37-338 ms (calls) and 12-173 ms (health), refusals 0.04-1.1 s:
the p99s over 100 ms there move from phase to phase with the machine's load. The old proxy never refuses
count_tokens: it answers 200 after tokenizing the 5 MB.
"""

from __future__ import annotations

import argparse
import http.client
import json
import resource
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gyre.engine.launcher import start_engine
from gyre.model.random_model import SHAPES, create_random_model
from tools.bench_proxy_latency import percentile, start_proxy

ROOT = Path(__file__).resolve().parents[1]
FIVE_MB = "The quick brown fox jumps over the lazy dog. " * 116_000
VALID = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1}).encode()
IDLE_CONNECTIONS = 1044


def bad_bodies() -> dict[str, tuple[str, bytes]]:
    """name -> (path, body), each as an official SDK would send it."""
    user = {"role": "user", "content": "Go on."}
    tool = {"type": "function", "function": {"name": "run", "description": "Run a command.",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}  # fmt: skip
    chat = "/rollout/bad/v1/chat/completions"
    bodies = {
        "5 MB assistant turn": {"messages": [user, {"role": "assistant", "content": FIVE_MB}, user]},
        "5 MB tool description": {
            "messages": [user],
            "tools": [{"type": "function", "function": {"name": "t", "description": FIVE_MB}}],
        },
        "131K tiny messages": {"messages": [{"role": "user", "content": "x"}] * 131_072},
        "60K tools": {
            "messages": [user],
            "tools": [{**tool, "function": {**tool["function"], "name": f"run_{i}"}} for i in range(60_000)],
        },  # fmt: skip
    }
    out = {name: (chat, json.dumps({"model": "m", "max_tokens": 1, **b}).encode()) for name, b in bodies.items()}
    count = {"model": "m", "messages": [{"role": "user", "content": FIVE_MB}]}
    out["5 MB count_tokens"] = ("/rollout/bad/v1/messages/count_tokens", json.dumps(count).encode())
    return out


def exchange(url: str, method: str, path: str, body: bytes | None, timeout: float) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", "anthropic-version": "2023-06-01"} if body else {}
        conn.request(method, path, body, headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return 0  # refused, reset or timed out
    finally:
        conn.close()


@dataclass
class Probe:
    """Sends one request again and again on fresh connections; keeps (start, seconds, status)."""

    url: str
    method: str
    path: str
    body: bytes | None
    pause_s: float
    samples: list[tuple[float, float, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            status = exchange(self.url, self.method, self.path, self.body, 120)
            self.samples.append((t0, time.perf_counter() - t0, status))
            time.sleep(self.pause_s)

    def window(self, t0: float, t1: float) -> tuple[list[float], int]:
        """(latencies of requests started in [t0, t1], how many were not answered 200)."""
        picked = [(s, st) for start, s, st in self.samples if t0 <= start <= t1]
        return [s for s, _ in picked], sum(st != 200 for _, st in picked)


def hold_idle_connections(url: str, seconds: float) -> tuple[float, int]:
    """Open IDLE_CONNECTIONS connections that never send anything, hold them; (seconds, statuses seen: 0)."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=5))
            except OSError:
                break
        time.sleep(seconds)
    finally:
        for s in socks:
            s.close()
    return seconds, len(socks)


def phase(url: str, name: str, path: str, body: bytes, window_s: float, timeout_s: float) -> tuple[list[float], int]:
    """Send the bad body again and again for at least window_s; (each refusal's seconds, last status)."""
    took, status = [], 0
    t_end = time.perf_counter() + window_s
    while not took or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        status = exchange(url, "POST", path, body, timeout_s)
        took.append(time.perf_counter() - t0)
        if took[-1] >= timeout_s:
            break
    return took, status


def measure(url: str, window_s: float, timeout_s: float) -> list[dict]:
    calls = Probe(url, "POST", "/rollout/good/v1/chat/completions", VALID, 0.0)
    health = Probe(url, "GET", "/health", None, 0.02)
    threads = [threading.Thread(target=p.run, daemon=True) for p in (calls, health)]
    for t in threads:
        t.start()
    rows = []
    try:
        phases: list[tuple[str, str | None, bytes | None]] = [("quiet", None, None)]
        phases += [(name, path, body) for name, (path, body) in bad_bodies().items()]
        phases.append((f"{IDLE_CONNECTIONS} idle connections", None, None))
        for name, path, body in phases:
            t0 = time.perf_counter()
            if name == "quiet":
                time.sleep(window_s)
                took, status = [], 0
            elif body is None:
                _, n = hold_idle_connections(url, window_s)
                took, status = [], n
            else:
                took, status = phase(url, name, path, body, window_s, timeout_s)
            t1 = time.perf_counter()
            time.sleep(0.3)  # requests started in the window finish
            row = {"phase": name, "bad_status": status, "bad_sends": len(took)}
            if took:
                row["refusal_s_median"] = statistics.median(took)
                row["refusal_s_max"] = max(took)
            for label, probe in (("calls", calls), ("health", health)):
                xs, errors = probe.window(t0, t1)
                row[f"{label}_n"], row[f"{label}_errors"] = len(xs), errors
                row[f"{label}_p50_ms"] = statistics.median(xs) * 1e3 if xs else float("nan")
                row[f"{label}_p99_ms"] = percentile(xs, 0.99) * 1e3 if xs else float("nan")
            rows.append(row)
            print(json.dumps(row), flush=True)
            time.sleep(1.0)  # the proxy settles before the next phase
    finally:
        for p in (calls, health):
            p.stop.set()
        for t in threads:
            t.join(130)
    return rows


def table(results: dict[str, list[dict]]) -> str:
    lines = [
        "| phase | proxy | calls p50 / p99 ms (errors) | /health p50 / p99 ms (errors) | bad body refused in s (status) |",
        "|---|---|---|---|---|",
    ]
    names = [r["phase"] for r in next(iter(results.values()))]
    for i, name in enumerate(names):
        for who, rows in results.items():
            r = rows[i]
            refusal = f"{r['refusal_s_median']:.2f} ({r['bad_status']})" if "refusal_s_median" in r else "-"
            if name.endswith("idle connections"):
                refusal = f"{r['bad_status']} held"
            lines.append(
                f"| {name} | {who} | {r['calls_p50_ms']:.0f} / {r['calls_p99_ms']:.0f} ({r['calls_errors']}) "
                f"| {r['health_p50_ms']:.0f} / {r['health_p99_ms']:.0f} ({r['health_errors']}) | {refusal} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-root", default="", help="checkout whose proxy is the baseline (e.g. /work/main); none: skip")
    p.add_argument("--new-root", default=str(ROOT), help="checkout whose proxy is measured (default: this one)")
    p.add_argument("--window-s", type=float, default=3.0, help="each phase lasts at least this long")
    p.add_argument("--timeout-s", type=float, default=90.0, help="a bad body not answered by then counts as hung")
    args = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))  # 1,044 idle + the proxy's
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-stall-"))
    model_dir = create_random_model(work / "ckpt", SHAPES["qwen3-tiny"], dtype=torch.float32)
    roots = {"old": Path(args.old_root)} if args.old_root else {}
    roots["new"] = Path(args.new_root)
    results = {}
    with start_engine(model_dir, num_threads=1, max_context_tokens=4096, max_running_requests=32) as engine:
        for who, root in roots.items():
            proc, url = start_proxy(root, model_dir, engine.url, work / f"proxy_{who}.log")
            try:
                print(f"--- {who}: proxy from {root}", flush=True)
                results[who] = measure(url, args.window_s, args.timeout_s)
            finally:
                proc.terminate()
                proc.wait(30)
    print(table(results))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
