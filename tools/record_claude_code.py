"""Record a real Claude Code session through the proxy (regenerates tests/data/claude_code_calls.jsonl).

The pinned `claude` CLI runs offline on a built-in task workspace against the proxy, backed by the
embedded engine serving a tiny policy; one session takes the task prompt, then the follow-up
`/delegate <task>`, a workspace skill that runs in a forked sub-agent. A tiny model neither finishes
tasks nor fills a context nor picks the Agent tool, so real mechanisms make the session long enough
to compact in both threads, none of them scripting the model:
- the policy is trained for a few seconds to answer briefly (its replies end with <|im_end|>);
- the workspace carries Claude Code Stop and SubagentStop hooks (`.claude/settings.json`) that send
  each thread back to work `blocks` times, the "keep going until done" loop agent harnesses use;
- the proxy forces the context limit of each thread to its first prompt + `extra_tokens` until Claude
  Code has compacted it (prompt too long -> reactive compaction -> a summary call -> a new thread).

    python -m tools.record_claude_code [--out tests/data/claude_code_calls.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import shutil
import sysconfig
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gyre.config.schema import HarnessConfig, ModelConfig, ProxyConfig, SandboxConfig, TaskConfig
from gyre.engine.launcher import start_engine
from gyre.harness.runner import RolloutOutcome, run_rollout
from gyre.model.chat_template import IM_END, render_text
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog, CallRecord
from gyre.proxy.keys import RolloutKeys
from gyre.proxy.server import ProxyServer
from gyre.sandbox import make_sandbox
from gyre.tasks.suite import sample_tasks
from gyre.tasks.task import Task

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "claude_code_calls.jsonl"
STDLIB_TEXTS = ("argparse", "subprocess", "pathlib", "typing", "shutil", "tarfile", "logging/__init__", "inspect",
                "asyncio/events", "unittest/case", "http/client", "urllib/request", "dataclasses", "functools",
                "enum", "difflib", "textwrap", "pdb", "doctest", "pydoc", "tempfile", "threading", "configparser")  # fmt: skip
CONTEXT_TOKENS = 32768
ROLLOUT_ID = "cc-0"
KEEP_GOING = """import json, pathlib, sys
thread, blocks = sys.argv[1], int(sys.argv[2])
state = pathlib.Path(__file__).with_name("keep_going." + thread)
n = int(state.read_text()) if state.exists() else 0
if n < blocks:
    state.write_text(str(n + 1))
    print(json.dumps({{"decision": "block", "reason": "Not finished yet (%d/%d). " % (n + 1, blocks) + {reason!r}}}))
"""
ADVICE = ("Check the workspace before you stop. List the files, create the requested file if it is missing, "
          "make its content exactly the requested text with no extra spaces or newlines, read it back, and "
          "compare it with the task character by character. If a check fails, fix the file and run the checks "
          "again; do not create other files and do not change files the task does not name. Report what you "
          "changed in one short sentence, then stop only when every check passes. Keep your answers short: "
          "long answers waste the context you need for the remaining work, and the session is compacted when "
          "the context is full, so write down anything you still need in the workspace.")  # fmt: skip
SKILL = "---\nname: delegate\ndescription: Hand a task to a sub-agent\ncontext: fork\nagent: general-purpose\n---\n\n$ARGUMENTS\n"


def english_corpus() -> list[str]:
    """Prose and code from Python's own library: enough English for Claude Code's prompts to tokenize
    at ~2.4 characters a token (a task-only vocabulary manages ~1.2)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [(lib / f"{name}.py").read_text() for name in STDLIB_TEXTS]


def build_policy(root: Path, steps: int = 300, seed: int = 0) -> Path:
    """A tiny Llama (vocab 2048, 2 layers) trained briefly to give short replies; returns its checkpoint."""
    torch.manual_seed(seed)
    texts = english_corpus()
    tok = Tokenizer.train(texts, vocab_size=2048)
    tok.save(root / "tok")
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128, max_position_embeddings=CONTEXT_TOKENS)  # fmt: skip
    model = LlamaForCausalLM(cfg)
    words = re.findall(r"[A-Za-z]{3,12}", texts[0])
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        chunk = lambda n: " ".join(rng.choice(words) for _ in range(n))  # noqa: E731
        prompt = tok.encode(
            render_text([{"role": "system", "content": chunk(40)}, {"role": "user", "content": chunk(30)}])
        )
        reply = tok.encode(chunk(rng.randint(1, 4)).capitalize() + "." + IM_END)
        seq = torch.tensor([prompt + reply])
        logits = model(seq[:, :-1], torch.arange(seq.shape[1] - 1)[None])[0][0, len(prompt) - 1 :]
        loss = torch.nn.functional.cross_entropy(logits, seq[0, len(prompt) :])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return save_hf_checkpoint(root / "ckpt", model.state_dict(), cfg, root / "tok")


def keep_going_task(blocks: int, seed: int = 0) -> Task:
    """A built-in write_value task whose workspace sends each Claude Code thread back to work `blocks`
    times and has a `/delegate` skill that forks a sub-agent."""
    (task,) = sample_tasks(["write_value"], 1, seed)

    def hook(thread: str) -> list[dict]:
        command = f'python3 "$CLAUDE_PROJECT_DIR/.claude/keep_going.py" {thread} {blocks}'
        return [{"hooks": [{"type": "command", "command": command}]}]

    files = {
        ".claude/settings.json": json.dumps({"hooks": {"Stop": hook("main"), "SubagentStop": hook("subagent")}}),
        ".claude/keep_going.py": KEEP_GOING.format(reason=f"The task was: {task.prompt} {ADVICE}"),
        ".claude/skills/delegate/SKILL.md": SKILL,
    }
    return dataclasses.replace(task, files={**task.files, **files}, max_turns=4 * blocks)


def off_loopback(trace: Path) -> list[str]:
    """strace lines (connect/send*) that name an IPv4/IPv6 address other than loopback."""
    bad = []
    for line in trace.read_text().splitlines():
        v4 = re.findall(r'inet_addr\("([\d.]+)"\)', line)
        v6 = re.findall(r'inet_pton\(AF_INET6, "([0-9a-fA-F:.]+)"', line)
        if any(not a.startswith("127.") for a in v4) or any(
            a not in ("::1", "::") and not a.startswith("::ffff:127.") for a in v6
        ):
            bad.append(line)
    return bad


@dataclass
class Recording:
    calls_jsonl: Path
    net_trace: Path
    records: list[CallRecord] = field(default_factory=list)
    outcome: RolloutOutcome | None = None
    limits: dict[str, int] = field(default_factory=dict)  # thread role -> the context limit forced on it
    lifted_after: dict[str, int] = field(default_factory=dict)  # thread role -> the summary call that lifted it


def _watch_limits(proxy: ProxyServer, extra_tokens: int, done: threading.Event, rec: Recording) -> None:
    """Threads run one after the other: force a limit when a thread's first prompt is known, lift it
    once that thread has been summarized."""
    while not done.wait(0.02):
        records = proxy.call_log.for_rollout(ROLLOUT_ID)
        for role in ("main", "subagent"):
            first = next((r for r in records if r.role == role), None)
            summary = next((r for r in records if r.role == f"{role}_summary"), None)
            if first is not None and role not in rec.limits:
                rec.limits[role] = first.prompt_tokens + extra_tokens
                proxy.force_context_limit(ROLLOUT_ID, rec.limits[role])
            if summary is not None and role not in rec.lifted_after:
                rec.lifted_after[role] = summary.call_id
                proxy.force_context_limit(ROLLOUT_ID, None)


def record_session(root: Path, blocks: int = 15, extra_tokens: int = 3000, timeout_s: float = 900.0) -> Recording:
    root.mkdir(parents=True, exist_ok=True)
    engine = start_engine(build_policy(root / "policy"), max_context_tokens=CONTEXT_TOKENS,
                          prefix_cache_tokens=4 * CONTEXT_TOKENS, log_path=root / "engine.log")  # fmt: skip
    calls_jsonl = root / "calls.jsonl"
    keys = RolloutKeys()  # as in a run: Claude Code's ANTHROPIC_API_KEY is the rollout's own key
    proxy = ProxyServer(
        Tokenizer.load(root / "policy" / "tok"),
        [engine.url],
        ProxyConfig(max_context_tokens=CONTEXT_TOKENS, max_output_tokens=24),
        CallLog(calls_jsonl),
        keys=keys,
    )
    task = keep_going_task(blocks)
    rec = Recording(calls_jsonl, root / "net.trace")
    done = threading.Event()
    env = {
        "GYRE_CLAUDE_TRACE": str(rec.net_trace),
        "GYRE_CLAUDE_FOLLOW_UPS": json.dumps([f"/delegate {task.prompt}"]),
        "CLAUDE_CODE_STOP_HOOK_BLOCK_CAP": str(blocks + 5),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # bwrap as by default, but without the seccomp filter: it refuses ptrace, which the strace of the trace needs
    sandbox = make_sandbox(SandboxConfig(seccomp=False))
    watcher = threading.Thread(target=_watch_limits, args=(proxy, extra_tokens, done, rec), daemon=True)
    try:
        proxy.start()
        watcher.start()
        harness = HarnessConfig(kind="claude_code", max_turns=4 * blocks, timeout_s=timeout_s)
        rec.outcome = asyncio.run(
            run_rollout(
                task, ROLLOUT_ID, proxy.url, root / "rollout", harness, TaskConfig(), keys=keys, sandbox=sandbox
            )
        )
    finally:
        done.set()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proxy.stop()
        engine.stop()
    rec.records = proxy.call_log.for_rollout(ROLLOUT_ID)
    return rec


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--keep", action="store_true", help="keep the work directory (engine log, workspace, trace)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="gyre-cc-record-"))
    rec = record_session(root)
    roles = Counter(r.role for r in rec.records)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(rec.calls_jsonl, args.out)
    assert rec.outcome is not None
    print(f"{len(rec.records)} calls ({', '.join(f'{n} {r}' for r, n in sorted(roles.items()))}), "
          f"stop {rec.outcome.stop_reason}, grade {rec.outcome.grade.to_dict()} -> {args.out}")  # fmt: skip
    if off_loopback(rec.net_trace):
        raise SystemExit(f"traffic left loopback; see {rec.net_trace}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
