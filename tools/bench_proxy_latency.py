"""The proxy's added latency per call, two proxy versions side by side in front of one engine.

    git worktree add /tmp/gyre-base <base commit>
    python -m tools.bench_proxy_latency --old-root /tmp/gyre-base --calls 300

starts one embedded engine (a tiny random model), then a proxy from this checkout and one from
`--old-root` (another checkout, e.g. the base commit), each its own process. Each round sends the same
call to the engine directly (/generate with the rendered prompt's ids, one token) and through both
proxies (OpenAI Chat Completions and Anthropic Messages, one token), in shuffled order over kept-alive
connections. A proxy's added latency is its round trip minus the direct one of the same round; the
report gives medians and p90 per API and the new/old ratio of the medians.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gyre.engine.launcher import start_engine
from gyre.model.random_model import SHAPES, create_random_model
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog
from gyre.proxy.tito import TitoRenderer

ROOT = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"Tool number {i}.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    "required": ["path"]}}} for i in range(8)]  # fmt: skip


def conversation(turns: int) -> list[dict]:
    """A harness-like history: system prompt, then user/assistant/tool turns (replies the proxy never made)."""
    messages = [{"role": "system", "content": "You are a coding agent. Work in the workspace. " * 20}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"Step {t}: write the value {t} into out_{t}.txt and check it."})
        call = {
            "id": f"x{t}",
            "type": "function",
            "function": {"name": "tool_1", "arguments": json.dumps({"path": f"out_{t}.txt"})},
        }
        messages.append({"role": "assistant", "content": "I will write it.", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"x{t}", "content": f"wrote out_{t}.txt\n" * 5})
    return messages


def anthropic_body(messages: list[dict]) -> dict:
    out = []
    for m in messages[1:]:
        if m["role"] == "user":
            out.append({"role": "user", "content": m["content"]})
        elif m["role"] == "assistant":
            call = m["tool_calls"][0]
            use = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                   "input": json.loads(call["function"]["arguments"])}  # fmt: skip
            out.append({"role": "assistant", "content": [{"type": "text", "text": m["content"]}, use]})
        else:
            out.append(
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}],
                }
            )
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    return {
        "model": "m",
        "max_tokens": 1,
        "temperature": 0,
        "system": messages[0]["content"],
        "messages": out,
        "tools": tools,
    }


def start_proxy(root: Path, tokenizer_dir: Path, engine_url: str, log: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gyre.proxy.server", "--tokenizer", str(tokenizer_dir), "--engine", engine_url,
           "--max-context-tokens", "4096"]  # fmt: skip
    out = open(log, "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"listening on (http://\S+)", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise RuntimeError(f"the proxy from {root} exited:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"the proxy from {root} did not start; log {log}")


class Conn:
    """A kept-alive HTTP connection; `post` returns the round-trip seconds (the answer must be 200)."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> float:
        t0 = time.perf_counter()
        self.conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        resp = self.conn.getresponse()
        data = resp.read()
        elapsed = time.perf_counter() - t0
        if resp.status != 200:
            raise RuntimeError(f"POST {path} -> {resp.status}: {data[:300]!r}")
        return elapsed


def percentile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--old-root", required=True, help="checkout whose proxy is the baseline (e.g. a worktree of the base commit)"
    )
    p.add_argument("--calls", type=int, default=300, help="rounds per API")
    p.add_argument("--turns", type=int, default=6, help="conversation turns in each call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-root", default=str(ROOT), help="checkout whose proxy is measured (default: this one)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="gyre-bench-proxy-"))
    model_dir = create_random_model(work / "ckpt", SHAPES["qwen3-tiny"], dtype=torch.float32)
    tokenizer = Tokenizer.load(model_dir)
    messages = conversation(args.turns)
    chat = json.dumps({"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 1, "temperature": 0}).encode()
    a_body = anthropic_body(messages)
    messages_body = json.dumps(a_body).encode()
    ids = TitoRenderer(tokenizer, CallLog()).render("x", messages, TOOLS).input_ids
    sampling = {"temperature": 0.0, "max_new_tokens": 1, "skip_special_tokens": False, "no_stop_trim": True}
    generate = json.dumps({"input_ids": ids, "sampling_params": sampling, "return_logprob": True}).encode()
    rng = random.Random(args.seed)
    with start_engine(model_dir, num_threads=1, max_context_tokens=4096) as engine:
        procs = {}
        try:
            for name, root in (("old", Path(args.old_root)), ("new", Path(args.new_root))):
                procs[name] = start_proxy(root, model_dir, engine.url, work / f"proxy_{name}.log")
            direct = Conn(engine.url)
            proxies = {name: Conn(url) for name, (_, url) in procs.items()}
            added: dict[tuple[str, str], list[float]] = {(n, api): [] for n in procs for api in ("openai", "anthropic")}
            directs: list[float] = []
            hdr = {"anthropic-version": "2023-06-01"}
            for i in range(args.calls + 20):  # the first 20 rounds warm caches up and are not counted
                for api, path, body, headers in (("openai", "/v1/chat/completions", chat, None),
                                                 ("anthropic", "/v1/messages", messages_body, hdr)):  # fmt: skip
                    order = ["direct", *procs]
                    rng.shuffle(order)
                    times = {}
                    for who in order:
                        conn = direct if who == "direct" else proxies[who]
                        times[who] = conn.post(
                            "/generate" if who == "direct" else path, generate if who == "direct" else body, headers
                        )
                    if i >= 20:
                        directs.append(times["direct"])
                        for name in procs:
                            added[(name, api)].append(times[name] - times["direct"])
        finally:
            for proc, _ in procs.values():
                proc.terminate()
                proc.wait(10)
    print(f"prompt {len(ids)} tokens, {args.turns} turns, {len(TOOLS)} tools; {args.calls} rounds per API")
    print(f"engine direct /generate: p50 {statistics.median(directs) * 1e3:.2f} ms")
    print(f"{'api':<10} {'proxy':<5} {'added p50 ms':>13} {'added p90 ms':>13}")
    report = {}
    for (name, api), xs in sorted(added.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        report[f"{api}_{name}_p50_ms"] = statistics.median(xs) * 1e3
        print(f"{api:<10} {name:<5} {statistics.median(xs) * 1e3:>13.2f} {percentile(xs, 0.9) * 1e3:>13.2f}")
    for api in ("openai", "anthropic"):
        ratio = report[f"{api}_new_p50_ms"] / report[f"{api}_old_p50_ms"]
        report[f"{api}_ratio"] = ratio
        print(f"{api}: new/old added latency (p50) = {ratio:.2f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
