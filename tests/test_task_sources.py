"""Task suites on disk: Harbor task directories and SWE-bench instances, their loading, split and
sampling, grading in the sandbox (tests only there, the reward read there, failures never a pass),
the Apptainer image mapping, the oracle check and the run's provenance."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_harness import STALL, ScriptedServer, tool_reply

from gyre.config.load import compose
from gyre.config.schema import HarnessConfig, RunConfig, SandboxConfig, TaskConfig
from gyre.config.validate import ConfigValueError
from gyre.harness.runner import RolloutOutcome, run_rollout
from gyre.metrics import read_metrics
from gyre.pipeline import FinishedRollout, task_provenance
from gyre.sandbox import ApptainerSandbox, Mount, SandboxJob, SandboxUnavailable, make_sandbox
from gyre.sandbox.backends import check_task_images
from gyre.sandbox.base import ENV_ALLOWLIST
from gyre.sched.controller.report import step_rows
from gyre.store.reader import read_shard
from gyre.tasks.grading import Grade, grade_workspace
from gyre.tasks.harbor import TaskFormatError, load_harbor_task, workspace_from_dockerfile
from gyre.tasks.harbor_checker import read_rewards, score_of
from gyre.tasks.oracle import apply_patch, reference_patch
from gyre.tasks.source import load_instances, split_of
from gyre.tasks.suite import TaskPool
from gyre.tasks.swebench import load_swebench_tasks
from gyre.tasks.swebench_checker import parse_pytest, parse_unittest, report
from gyre.tasks.task import GIT_ENV, commit_tree
from tools import check_tasks

ROOT = Path(__file__).resolve().parents[1]
HARBOR = ROOT / "examples" / "tasks" / "harbor"
SWEBENCH = ROOT / "examples" / "tasks" / "swebench" / "instances.jsonl"
BROKEN = ROOT / "tests" / "data" / "broken_tasks"
GOLDEN = ROOT / "tests" / "golden" / "apptainer_task_image.txt"


def swebench_task(instance_id: str):
    (task,) = [t for t in load_swebench_tasks(SWEBENCH) if t.task_id == instance_id]
    return task


# ---------------------------------------------------------------- loading (unit)


@pytest.mark.unit
def test_harbor_directory_becomes_a_task_without_its_tests():
    task = load_harbor_task(HARBOR / "fix-median")
    assert task.task_id == "fix-median" and task.family == task.source == task.checker == "harbor"
    assert task.prompt.startswith("The `stats` package in /app has a bug")
    assert sorted(task.files) == ["stats/__init__.py", "stats/core.py"] and task.workdir == "/app"
    assert sorted(task.hidden_files) == ["test.sh", "test_outputs.py"]
    assert (task.image, task.agent_timeout_s, task.check_timeout_s) == ("python:3.11-slim", 120.0, 20.0)
    view = json.dumps(task.harness_view())
    test_sh = base64.b64decode(task.hidden_files["test_outputs.py"]).decode()
    assert "test_median_even" in test_sh and "test_median_even" not in view and "hidden_files" not in view
    assert load_harbor_task(HARBOR / "write-config").grading["env"] == {"EXPECTED_DB": "gyre"}


@pytest.mark.unit
def test_dockerfile_copies_outside_the_working_directory_are_refused(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("a")
    (tmp_path / "Dockerfile").write_text("FROM x\nWORKDIR /app\nCOPY src/ ./lib/\nCOPY src/a.txt b.txt\nRUN make\n")
    (tmp_path / "src" / "a.txt").chmod(0o755)
    assert workspace_from_dockerfile(tmp_path) == ("/app", {"lib/a.txt": "a", "b.txt": "a"}, ["b.txt", "lib/a.txt"])
    (tmp_path / "Dockerfile").write_text("FROM x\nWORKDIR /app\nCOPY src/a.txt /usr/local/bin/\n")
    with pytest.raises(TaskFormatError, match="outside the working directory /app"):
        workspace_from_dockerfile(tmp_path)


@pytest.mark.unit
def test_swebench_instance_is_the_repo_at_base_commit(tmp_path):
    task = swebench_task("gyre-examples__calc-1")
    row = json.loads(SWEBENCH.read_text().splitlines()[0])
    assert task.prompt == row["problem_statement"].strip() and task.source_path == f"{SWEBENCH}:1"
    assert set(task.grading["reset_files"]) == {"tests/test_ops.py"}
    assert task.grading["test_cmd"] == ["python3", "-m", "unittest", "-v", "tests.test_ops"]
    assert task.grading["FAIL_TO_PASS"] == ["tests.test_ops.TestOps.test_div_by_zero"]
    view = json.dumps(task.harness_view())
    assert "test_div_by_zero" not in view and row["patch"] not in json.dumps(dataclasses.asdict(task))
    workspace = task.materialize(tmp_path / "ws")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=workspace, capture_output=True, text=True).stdout
    assert head.strip() == row["base_commit"]  # the agent starts from the instance's own commit


@pytest.mark.unit
def test_a_snapshot_that_is_not_base_commit_is_refused(tmp_path):
    shutil.copytree(SWEBENCH.parent, tmp_path / "suite")
    (tmp_path / "suite" / "repos" / "gyre-examples__calc" / "calc" / "ops.py").write_text("changed\n")
    with pytest.raises(TaskFormatError, match="not the instance's base_commit"):
        load_swebench_tasks(tmp_path / "suite" / "instances.jsonl")


@pytest.mark.unit
def test_split_is_stable_and_the_pool_is_sampled_by_seed():
    cfg = TaskConfig(source="swebench", path=str(SWEBENCH), split="all")
    every = load_instances(cfg)
    train = load_instances(dataclasses.replace(cfg, split="train"))
    held = load_instances(dataclasses.replace(cfg, split="eval"))
    assert len(every) == 8 and {t.task_id for t in train} | {t.task_id for t in held} == {t.task_id for t in every}
    assert not {t.task_id for t in train} & {t.task_id for t in held} and held
    assert all(split_of(t.task_id, 0.25) == "eval" for t in held)
    pool = lambda seed, size: [t.task_id for t in TaskPool(None, size, seed, every).tasks]  # noqa: E731
    assert pool(1, 3) == pool(1, 3) and len(pool(1, 3)) == 3 and pool(1, 3) != pool(2, 3)
    assert sorted(pool(1, 0)) == sorted(t.task_id for t in every)  # 0: the whole split
    steps = TaskPool(None, 0, 7, every)
    first_epoch = [t.task_id for s in range(2) for t in steps.for_step(s, 4)]
    assert sorted(first_epoch) == sorted(t.task_id for t in every)  # each instance once per epoch


@pytest.mark.unit
def test_task_config_fails_early_naming_the_key():
    with pytest.raises(ConfigValueError, match="tasks.source"):
        TaskConfig(source="nl2repo")
    with pytest.raises(ConfigValueError, match="tasks.path"):
        TaskConfig(source="harbor")
    with pytest.raises(ConfigValueError, match="tasks.split"):
        TaskConfig(split="test")
    with pytest.raises(ConfigValueError, match="sandbox.backend"):
        RunConfig(tasks=TaskConfig(source="harbor", path=str(HARBOR)), sandbox=SandboxConfig(backend="none"))
    with pytest.raises(ConfigValueError, match="sandbox.backend"):
        compose(["tasks=harbor_examples", "sandbox.backend=none"])
    harbor, swe = compose(["tasks=harbor_examples"]), compose(["tasks=swebench_examples"])
    assert (harbor.tasks.source, harbor.tasks.path) == ("harbor", "examples/tasks/harbor")
    assert (swe.tasks.source, swe.tasks.path) == ("swebench", "examples/tasks/swebench/instances.jsonl")


# ---------------------------------------------------------------- grading rules (unit)


@pytest.mark.unit
def test_swebench_log_parsers_and_grading_rules():
    log = ("test_a (tests.t.T.test_a) ... ok\ntest_b (tests.t.T) ... FAIL\ntest_c (tests.t.T.test_c) ... skipped 'x'\n"
           "test_d (tests.t.T.test_d) ... ERROR\n")  # fmt: skip
    status = parse_unittest(log)
    assert status == {"tests.t.T.test_a": "PASSED", "tests.t.T.test_b": "FAILED", "tests.t.T.test_c": "SKIPPED",
                      "tests.t.T.test_d": "ERROR"}  # fmt: skip
    assert parse_pytest("PASSED t.py::a\nFAILED t.py::b - boom\nnoise\n") == {"t.py::a": "PASSED", "t.py::b": "FAILED"}
    a, b, c = "tests.t.T.test_a", "tests.t.T.test_b", "tests.t.T.test_c"
    assert report(status, [a, b], [c])["score"] == 0.5  # partial: one of two FAIL_TO_PASS, skipped P2P holds
    assert report(status, [a], ["tests.t.T.test_d"])["score"] == 0.0  # a broken PASS_TO_PASS gates it to 0
    assert report(status, [c], [])["score"] == 0.0  # a skipped FAIL_TO_PASS is not a pass
    assert report(status, ["missing"], [])["results"][0] == {"name": "FAIL_TO_PASS: missing", "passed": False,
                                                            "detail": "missing"}  # fmt: skip


@pytest.mark.unit
def test_harbor_rewards_as_harbor_reads_them(tmp_path):
    (tmp_path / "reward.json").write_text('{"a": 1, "b": 0, "c": 1}')
    assert score_of(read_rewards(tmp_path)) == pytest.approx(2 / 3)
    (tmp_path / "reward.txt").write_text("0.25\n")  # reward.txt wins (Harbor's reward_parser: txt > json)
    assert read_rewards(tmp_path) == {"reward": 0.25}
    (tmp_path / "reward.txt").unlink()
    for bad in ("", '{"a": "1"}', '{"a": NaN}', "{}", '{"a": true}'):
        (tmp_path / "reward.json").write_text(bad)
        with pytest.raises(ValueError):
            read_rewards(tmp_path)
    for bad in ("", "nan", "one"):
        (tmp_path / "reward.txt").write_text(bad)
        with pytest.raises(ValueError):
            read_rewards(tmp_path)


# ---------------------------------------------------------------- apptainer image mapping (unit, golden)


@pytest.mark.unit
def test_apptainer_runs_each_task_in_its_mapped_image(monkeypatch):
    for name in ENV_ALLOWLIST:  # the host's locale would enter the command line
        monkeypatch.delenv(name, raising=False)
    cfg = SandboxConfig(backend="apptainer", apptainer_images={"python:3.11-slim": "/sif/python_3.11-slim.sif"})
    job = SandboxJob(argv=["bash", "/tests/test.sh"], cwd="/app", env={"GYRE_API_KEY": "k"},
                     mounts=[Mount(Path("/scratch/ws"), "/workspace", True), Mount(Path("/scratch/ws"), "/app", True),
                             Mount(Path("/scratch/tests"), "/tests")], image="python:3.11-slim")  # fmt: skip
    text = " ".join(ApptainerSandbox(cfg).command(job)).replace(ApptainerSandbox(cfg).python, "PYTHON")
    assert text + "\n" == GOLDEN.read_text(), text
    with pytest.raises(SandboxUnavailable, match="sandbox.apptainer_images"):
        ApptainerSandbox(cfg).command(dataclasses.replace(job, image="ubuntu:24.04"))
    with pytest.raises(SandboxUnavailable, match="ubuntu:24.04"):
        check_task_images(cfg, ["python:3.11-slim", "ubuntu:24.04"])
    fallback = SandboxConfig(backend="apptainer", apptainer_image="/sif/all.sif")
    assert "/sif/all.sif" in ApptainerSandbox(fallback).command(job)  # no mapping: one image for every task


# ---------------------------------------------------------------- grading in the sandbox (integration)


@pytest.fixture(scope="module")
def sandbox():
    return make_sandbox(SandboxConfig())


@pytest.mark.integration
def test_harbor_grading_gives_partial_credit_and_reads_tests_read_only(tmp_path, sandbox):
    task = load_harbor_task(HARBOR / "write-config")
    ws = task.materialize(tmp_path / "ws")
    assert [p.name for p in ws.iterdir()] == []  # the tests never reach the agent's workspace
    (ws / "service.ini").write_text("[server]\nport = 8080\n[logging]\nlevel = debug\n")
    grade = grade_workspace(task, ws, sandbox=sandbox)
    assert (grade.status, grade.score, grade.passed, grade.total) == ("ok", pytest.approx(2 / 3), 2, 3)
    assert {c["name"]: c["passed"] for c in grade.checks} == {"server": True, "database": False, "logging": True}
    # agent code run by the tests cannot rewrite them: /tests is read-only in the grading sandbox
    sneaky = dataclasses.replace(task, hidden_files={
        "test.sh": base64.b64encode(b"echo x > /tests/test.sh && echo 1 > /logs/verifier/reward.txt || "
                                    b"echo 0 > /logs/verifier/reward.txt\n").decode()})  # fmt: skip
    assert grade_workspace(sneaky, ws, sandbox=sandbox).score == 0.0
    crash = dataclasses.replace(task, hidden_files={"test.sh": base64.b64encode(b"exit 1\n").decode()})
    # no reward file once the tests (which run the agent's code) have run: never a pass, and never an exclusion
    # a losing agent could choose (tools.check_tasks names such a task broken: its oracle gets no reward either)
    failed = grade_workspace(crash, ws, sandbox=sandbox)
    assert failed.status == "agent_failed" and failed.score == 0.0 and "no reward file" in failed.reason


# What agent code run by a task's tests may try, to win or to have a losing rollout excluded.
HARBOR_ATTACKS = {
    # hangs the tests: a checker that times out would be a failed evaluation, excluded from training
    "hang": ("while True:\n    pass\n", "tests_timeout"),
    # writes the reward, then kills test.sh before it writes its own 0: both refused by the reward guard (the
    # reward file cannot be written, test.sh cannot be signalled from its domain: Landlock ABI >= 6), graded 0
    "forge_and_kill": (
        "import os\ntry:\n    open('/logs/verifier/reward.txt', 'w').write('1')\nexcept OSError:\n    pass\n"
        "try:\n    os.kill(os.getppid(), 9)\nexcept OSError:\n    pass\n",
        None,
    ),
    # leaves a process behind that writes reward 1 once test.sh has written its 0 (the reward guard refuses the
    # write; the process stays)
    "rewrite_later": (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    p = '/logs/verifier/reward.txt'\n"
        "    while not os.path.exists(p):\n        time.sleep(0.001)\n"
        "    try:\n        open(p, 'w').write('1')\n    except OSError:\n        pass\n    time.sleep(30)\n",
        "tests_left_processes",
    ),
}


@pytest.mark.integration
@pytest.mark.parametrize("attack", sorted(HARBOR_ATTACKS))
def test_agent_code_run_by_harbor_tests_cannot_win_or_escape_scoring(attack, tmp_path, sandbox):
    code, reason = HARBOR_ATTACKS[attack]
    task = dataclasses.replace(load_harbor_task(HARBOR / "fix-median"), check_timeout_s=5.0)
    ws = task.materialize(tmp_path / "ws")
    init = ws / "stats" / "__init__.py"
    init.write_text(code + init.read_text())
    grade = grade_workspace(task, ws, sandbox=sandbox)
    if reason is None:
        assert (grade.status, grade.score) == ("ok", 0.0), grade
        return
    assert (grade.status, grade.score) == ("agent_failed", 0.0), grade
    assert grade.reason.startswith(reason + ":"), grade.reason


@pytest.mark.integration
def test_agent_code_run_by_swebench_tests_cannot_break_grading(tmp_path, sandbox):
    task = dataclasses.replace(swebench_task("gyre-examples__calc-1"), check_timeout_s=5.0)
    ws = task.materialize(tmp_path / "ws")
    shutil.rmtree(ws / "tests")  # the patched test file's directory is now a link out of the workspace
    (ws / "tests").symlink_to("/usr/lib")
    grade = grade_workspace(task, ws, sandbox=sandbox)  # graded as the unfixed code it is, not a broken evaluation
    assert (grade.status, grade.score) == ("ok", 0.0), grade
    hang = tmp_path / "hang"
    task.materialize(hang)
    ops = hang / "calc" / "ops.py"
    ops.write_text("while True:\n    pass\n" + ops.read_text())
    grade = grade_workspace(task, hang, sandbox=sandbox)
    assert (grade.status, grade.score) == ("agent_failed", 0.0) and grade.reason.startswith("tests_timeout:"), grade


@pytest.mark.integration
def test_swebench_grading_applies_the_test_patch_to_the_final_workspace(tmp_path, sandbox):
    task = swebench_task("gyre-examples__calc-2")
    ws = task.materialize(tmp_path / "ws")
    ops = ws / "calc" / "ops.py"  # a partial fix: negative exponents, but 0 ** -1 still raises ZeroDivisionError
    ops.write_text(ops.read_text().replace("    result = 1\n", "    if exp < 0:\n        return 1 / power(base, -exp)\n"
                                           "    result = 1\n", 1))  # fmt: skip
    (ws / "tests" / "test_ops.py").write_text("import unittest\n")  # the agent's edits to the tests are undone
    grade = grade_workspace(task, ws, sandbox=sandbox)
    assert (grade.status, grade.score) == ("ok", 0.5), grade
    assert {c["name"]: c["detail"] for c in grade.checks}[
        "FAIL_TO_PASS: tests.test_ops.TestOps.test_power_negative"
    ] == "PASSED"
    assert grade.total == 7 and grade.passed == 6
    broken = tmp_path / "broken"
    shutil.copytree(ws, broken)
    (broken / "calc" / "ops.py").write_text(ops.read_text().replace("return a + b", "return a - b"))
    assert grade_workspace(task, broken, sandbox=sandbox).score == 0.0  # PASS_TO_PASS broken: no credit
    fixed = tmp_path / "fixed"
    task.materialize(fixed)
    assert apply_patch(fixed, reference_patch(task)) == ""
    assert grade_workspace(task, fixed, sandbox=sandbox).success


@pytest.mark.integration
def test_slow_agent_times_out_and_the_preserved_workspace_is_graded(tmp_path):
    """The task's own agent limit ends the harness; its /app (the workspace) is graded by the hidden tests."""
    task = dataclasses.replace(load_harbor_task(HARBOR / "write-value"), agent_timeout_s=1.5)
    script = [tool_reply("write_file", 0, path="value.txt", content="rive"), STALL]

    async def main():
        async with ScriptedServer({"r": script}) as url:
            return await run_rollout(task, "r", url, tmp_path / "r", HarnessConfig(timeout_s=60.0), TaskConfig())

    outcome = asyncio.run(main())
    assert outcome.timed_out and outcome.wall_s < 10.0 and outcome.turns == 1  # killed while waiting for turn 2
    assert (outcome.grade.status, outcome.grade.score) == ("timeout", 0.5), outcome.grade  # exists, wrong word
    assert sorted(p.name for p in (tmp_path / "r" / "workspace").iterdir()) == ["value.txt"]


@pytest.mark.integration
@pytest.mark.parametrize("suite", ["harbor", "swebench"])
def test_oracle_check_passes_the_shipped_suites_and_reports_broken_tasks(suite, capsys):
    shipped, broken = (HARBOR, BROKEN / "harbor") if suite == "harbor" else (SWEBENCH, BROKEN / "swebench.jsonl")
    assert check_tasks.main([str(shipped)]) == 0
    out = capsys.readouterr().out
    assert "0 broken" in out and "BROKEN" not in out, out
    repos = [] if suite == "harbor" else ["--repos", str(SWEBENCH.parent / "repos")]
    assert check_tasks.main([str(broken), *repos]) == 1
    out = capsys.readouterr().out
    if suite == "harbor":
        assert "nop-passes: oracle 1, do-nothing 1 -> BROKEN: the do-nothing agent gets the full reward" in out
        assert "no-reward: oracle 0, do-nothing 0 -> BROKEN: the oracle gets 0, not the full reward 1: " in out
        assert "no reward file" in out and "0 of 2 tasks sound" in out
    else:
        assert "broken__wrong-patch: oracle 0, do-nothing 0 -> BROKEN: the oracle gets 0" in out


@pytest.mark.unit
def test_shards_record_source_path_and_instance():
    cfg = compose(["tasks=swebench_examples"])
    task = swebench_task("gyre-examples__calc-1")
    outcome = RolloutOutcome("r0", task, Grade("ok", 1.0, 1, 1), 1.0, 1, "finish", False)
    assert task_provenance(cfg, [FinishedRollout(0, outcome, [])]) == {
        "source": "swebench", "path": "examples/tasks/swebench/instances.jsonl", "split": "all",
        "instances": {"gyre-examples__calc-1": f"{SWEBENCH}:1"},
    }  # fmt: skip


@pytest.mark.integration
def test_main_job_trains_on_a_harbor_suite(tmp_path):
    """`make run ARGS="tasks=harbor_examples"` at a toy size, through the real CLI: rollouts of suite tasks are
    graded in the sandbox (none excluded) and stored with their provenance."""
    out = tmp_path / "run"
    args = ["tasks=harbor_examples", "steps=1", "rl.groups_per_step=2", "rl.group_size=2", "tasks.pool_size=2",
            "warm_start.steps=3", "warm_start.demos=16", "warm_start.batch_size=4", "tokenizer.corpus_tasks=60",
            "tokenizer.vocab_size=512", "harness.max_turns=2", "harness.max_tokens=24",
            f"warm_start.cache_dir={tmp_path / 'cache'}", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "launch.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = step_rows(read_metrics(out / "metrics.jsonl"))
    assert (row["n_rollouts"], row["n_scored"], row["n_excluded"]) == (4, 4, 0), row
    shards = [read_shard(p) for p in sorted((out / "shards").glob("*.h5"))]
    pool = {t.task_id for t in TaskPool.from_config(compose(args[:5]).tasks, seed=0).tasks}
    for shard in shards:
        tasks = json.loads(shard.attrs["producer"])["tasks"]
        assert (tasks["source"], tasks["path"], tasks["split"]) == ("harbor", "examples/tasks/harbor", "all")
        (instance,) = set(shard.rollouts["task_id"])
        assert instance in pool and tasks["instances"] == {instance: str(HARBOR / instance)}
        assert set(shard.rollouts["task_family"]) == {"harbor"}


@pytest.mark.unit
def test_a_git_repository_is_a_snapshot_too(tmp_path):
    """A snapshot may be a git repository holding base_commit (with later commits on top)."""
    repo = tmp_path / "repos" / "gyre-examples__calc"
    shutil.copytree(SWEBENCH.parent / "repos" / "gyre-examples__calc", repo)
    base = commit_tree(repo)
    (repo / "calc" / "ops.py").write_text("later\n")
    env = {**os.environ, **GIT_ENV}
    subprocess.run(["git", "commit", "-qam", "later"], cwd=repo, env=env, check=True)
    (tmp_path / "instances.jsonl").write_text(SWEBENCH.read_text().splitlines()[0] + "\n")
    (task,) = load_swebench_tasks(tmp_path / "instances.jsonl")
    assert json.loads(SWEBENCH.read_text().splitlines()[0])["base_commit"] == base
    assert task.files == swebench_task("gyre-examples__calc-1").files and "later" not in task.files["calc/ops.py"]
