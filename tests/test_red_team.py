"""Red team: a hostile harness (tests/red_team_agent.py) tries each attack of issue 15 during a real
step: five rollouts at once through the real proxy (rollout keys on) and an embedded engine, in the
default sandbox (bwrap) and, to show that the attacks are real and these tests can fail, with
sandbox.backend=none.

Sandbox-dependent attacks (each must fail under bwrap and work under none): reading the trainer's
environment, writing a sibling's workspace and the run's calls.jsonl / weights / checkpoint / shards /
warm-start cache, calling the engine's port, a way off the machine (under bwrap a connect to
10.255.255.1 fails at once for lack of a network; under none a non-loopback interface is the evidence,
no traffic is sent), using a sibling's key, stealing the hidden spec from the checker at grading
time, and a setsid process outliving the rollout. Attacks fixed whatever the backend (the grader's
files are no longer beside the workspace, attribution does not trust the harness's own report): a
guessed rollout id without its key, reading ../grade/spec.json, planting a directory or symlink at the
grader's old path, reporting a fake API error, killing the checker, and (issue 31) signalling or stopping
the checker from a losing answer's program to have the rollout excluded: scored 0 as the agent's failure
under both backends. In every case the run goes on: every rollout comes back with a recorded grade.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from gyre.config.domain import DOMAIN, OneOf
from gyre.config.schema import HarnessConfig, HarnessKind, ModelConfig, ProxyConfig, SandboxConfig, TaskConfig
from gyre.engine.launcher import start_engine
from gyre.harness import runner
from gyre.harness.runner import HarnessLaunch, run_rollouts
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog
from gyre.proxy.keys import RolloutKeys
from gyre.proxy.server import ProxyServer
from gyre.sandbox import make_sandbox
from gyre.tasks.task import Task

pytestmark = pytest.mark.integration
AGENT = Path(__file__).with_name("red_team_agent.py")
SECRET_VALUE = 4242  # the hidden expected value: never in a prompt
RUN_FILES = ("calls.jsonl", "weights/model.safetensors", "checkpoint/latest/state.pt", "shards/step00000.h5")
SANDBOX_DEPENDENT = ["read_env_secret", "write_sibling_workspace", "engine_direct", "network_out",
                     "forge_stolen_key", *(f"write_{Path(f).parts[0].split('.')[0]}" for f in RUN_FILES),
                     "write_cache"]  # fmt: skip


def red_team_command(launch: HarnessLaunch) -> list[str]:
    return [launch.python, f"{launch.workspace}/attack.py", "--base-url", launch.base_url,
            "--rollout-id", launch.rollout_id, "--workspace", str(launch.workspace),
            "--task-file", str(launch.task_file), "--result-file", str(launch.result_file)]  # fmt: skip


def task(mode: str, targets: dict | None = None) -> Task:
    check = {"name": "secret", "kind": "python_value", "path": "config.py", "var": "SECRET", "value": SECRET_VALUE}
    return Task(
        task_id=f"red-{mode}", family="red_team", prompt=json.dumps({"mode": mode, "targets": targets or {}}),
        files={"attack.py": AGENT.read_text(), "config.py": "SECRET = 0\n"}, checks=[check],
    )  # fmt: skip


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("red_team")
    tokenizer = Tokenizer.train([f"say {i} and stop" for i in range(100)], 300)
    tokenizer.save(root / "tok")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=1, num_attention_heads=2,
                      num_query_groups=1, ffn_hidden_size=64)  # fmt: skip
    engine = start_engine(save_hf_checkpoint(root / "ckpt", LlamaForCausalLM(cfg).state_dict(), cfg, root / "tok"),
                          log_path=root / "engine.log")  # fmt: skip
    try:
        yield tokenizer, engine
    finally:
        engine.stop()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.parametrize("backend", ["bwrap", "none"])
def test_attacks_fail_in_the_sandbox_and_work_without_it(stack, backend, tmp_path, monkeypatch):
    tokenizer, engine = stack
    monkeypatch.setitem(runner.HARNESS_COMMANDS, "red_team", red_team_command)
    kind = HarnessConfig.__dataclass_fields__["kind"]  # the schema declares the harness kinds: add this one
    monkeypatch.setattr(kind, "metadata", {DOMAIN: OneOf((*HarnessKind, "red_team"), "harness")})
    monkeypatch.setenv("GYRE_RED_TEAM_SECRET", "s3cr3t-token")
    run_dir = tmp_path / "run"  # the run's own files, as a run lays them out
    run_files = {Path(f).parts[0].split(".")[0]: run_dir / f for f in RUN_FILES}
    run_files["cache"] = tmp_path / "cache" / "gyre" / "warm_start" / "policy.pt"
    for path in run_files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("original\n")
    rollouts = run_dir / "rollouts" / "step0000"
    targets = {
        "sibling_id": "s0-g0-r4",
        "sibling_file": str(rollouts / "s0-g0-r4" / "workspace" / "config.py"),
        "run_files": {name: str(p) for name, p in run_files.items()},
        "engine_url": engine.url,
    }
    jobs = [(task("escape", targets), "s0-g0-r0"), (task("survivor"), "s0-g0-r1"), (task("false_excuse"), "s0-g0-r2"),
            (task("checker_killer"), "s0-g0-r3"), (task("victim", {"sleep_s": 5.0}), "s0-g0-r4"),
            (task("checker_signaller", {"signal": "SIGUSR1"}), "s0-g0-r5"),
            (task("checker_signaller", {"signal": "SIGSTOP"}), "s0-g0-r6")]  # fmt: skip
    keys, log = RolloutKeys(), CallLog()
    proxy = ProxyServer(tokenizer, [engine.url], ProxyConfig(max_context_tokens=512), log, keys=keys)
    harness = HarnessConfig(kind="red_team", timeout_s=8.0, concurrency=8)
    sandbox = make_sandbox(SandboxConfig(backend=backend))
    survivor_pid = None
    try:
        url = proxy.start()
        start = time.monotonic()
        outcomes = asyncio.run(run_rollouts(jobs, url, rollouts, harness, TaskConfig(), sandbox=sandbox, keys=keys))
        wall = time.monotonic() - start
        survivor_ws = rollouts / "s0-g0-r1" / "workspace"
        beat = (survivor_ws / "heartbeat").read_text()
        time.sleep(0.5)
        survived = (survivor_ws / "heartbeat").read_text() != beat  # still beating after the rollout ended
        if backend == "none":  # a host pid only without a PID namespace
            survivor_pid = int((survivor_ws / "survivor.pid").read_text())
    finally:
        proxy.stop()
        if survivor_pid is not None and alive(survivor_pid):
            os.kill(survivor_pid, signal.SIGKILL)  # started by this test's harness
    by_id = {o.rollout_id: o for o in outcomes}
    escape, survivor, excuse, killer, victim, signaller, stopper = (by_id[rid] for _, rid in jobs)
    report = json.loads((rollouts / "s0-g0-r0" / "workspace" / "report.json").read_text())
    worked = {name: r["ok"] for name, r in report.items()}
    forged = [r for _, rid in jobs[1:] for r in log.for_rollout(rid)]  # calls under a sibling's key
    assert worked["forge_stolen_key"] == bool(forged)  # a stolen key's call is recorded as its owner's

    # the run goes on: every rollout has a recorded grade, none stopped it
    assert len(outcomes) == 7 and wall < 40
    assert report["own_call"]["ok"], report["own_call"]  # the rollout's own endpoint works in both
    # fixed whatever the backend
    assert not worked["forge_guessed_id"] and "HTTP 401" in report["forge_guessed_id"]["detail"]
    assert not worked["read_grade_spec"]
    assert (excuse.grade.status, excuse.grade.score) == ("agent_failed", 0.0), excuse.grade
    assert excuse.grade.reason.startswith("harness_exit:")
    assert (killer.grade.status, killer.grade.score) == ("agent_failed", 0.0), killer.grade
    assert killer.grade.reason.startswith("checker_killed:")
    for graded, code in ((signaller, "checker_killed"), (stopper, "checker_stopped")):  # never an exclusion
        assert (graded.grade.status, graded.grade.score) == ("agent_failed", 0.0), graded.grade
        assert graded.grade.reason.startswith(code + ":"), graded.grade
    assert victim.grade.status == "ok" and escape.grade.status == "ok", (victim.grade, escape.grade)
    sibling_sabotaged = "sabotaged" in Path(targets["sibling_file"]).read_text()
    changed = {name: p.read_text() != "original\n" for name, p in run_files.items()}

    if backend == "bwrap":
        failed_attacks = [n for n in SANDBOX_DEPENDENT if worked[n]]
        assert failed_attacks == [], {n: report[n] for n in failed_attacks}
        assert "Network is unreachable" in report["network_out"]["detail"]
        assert not sibling_sabotaged and not any(changed.values()) and not forged
        assert escape.grade.score == 0.0  # the spec could not be read from the checker
        assert not survived and survivor.grade.status == "timeout" and survivor.grade.score == 0.0
    else:  # the same attacks, unsandboxed: each one works
        missing = [n for n in SANDBOX_DEPENDENT if not worked[n]]
        assert missing == [], {n: report[n] for n in missing}
        assert sibling_sabotaged and all(changed.values()) and forged
        assert escape.grade.score == 1.0  # graded with the value stolen from the checker
        assert survived
