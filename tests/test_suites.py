"""Suites that survive bad tasks: an unloadable task is skipped and named (tasks.strict refuses, tasks.min_tasks
floors the usable count, the CLI says so in one message), the skipped tasks reach the run's summary and the
shards' provenance; the oracle check reports built/oracle/noop/verdict/cause and names why a task is broken;
workspaces hold binary files; four real SWE-bench instances grade oracle 1 / no-op 0 under bwrap."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import gyre.tasks.task as task_module
from gyre.config.load import compose
from gyre.config.schema import SandboxConfig, TaskConfig
from gyre.config.validate import ConfigValueError
from gyre.harness.runner import RolloutOutcome
from gyre.pipeline import FinishedRollout, task_provenance
from gyre.sandbox import make_sandbox
from gyre.sched.controller.report import summary
from gyre.tasks.grading import Grade
from gyre.tasks.harbor import load_harbor_task
from gyre.tasks.oracle import _causes, check_task, name_cause
from gyre.tasks.source import SuiteError, load_suite, read_suite
from gyre.tasks.suite import TaskPool
from gyre.tasks.swebench import load_swebench_tasks
from gyre.tasks.task import GIT_ENV, TaskFormatError, commit_tree
from tools import check_tasks

ROOT = Path(__file__).resolve().parents[1]
BROKEN = ROOT / "tests" / "data" / "broken_tasks" / "harbor"
REAL = ROOT / "examples" / "tasks" / "swebench_real" / "instances.jsonl"
# Not UTF-8: a PNG signature, a NUL and a lone 0xff
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe" + bytes(range(256))
TOML = '[verifier]\ntimeout_sec = 20.0\n[agent]\ntimeout_sec = 60.0\n[environment]\ndocker_image = "python:3.11-slim"\n'


def harbor_task(root: Path, name: str, dockerfile: str, test_sh: str, solve_sh: str, files: dict | None = None) -> Path:
    d = root / name
    for rel, content in {
        "task.toml": TOML,
        "instruction.md": f"Task {name}.",
        "environment/Dockerfile": dockerfile,
        "tests/test.sh": test_sh,
        "solution/solve.sh": solve_sh,
        **(files or {}),
    }.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(content if isinstance(content, bytes) else textwrap.dedent(content).encode())
    return d


def sound_task(root: Path) -> Path:
    """Writes 42 to answer.txt; its tests also check that the binary logo reached the workspace intact."""
    digest = hashlib.sha256(PNG).hexdigest()
    test_sh = f"""\
        #!/bin/bash
        ok=1
        [ "$(cat /app/answer.txt 2>/dev/null)" = 42 ] || ok=0
        [ "$(sha256sum /app/assets/logo.png | cut -d' ' -f1)" = {digest} ] || ok=0
        echo $ok > /logs/verifier/reward.txt
        """
    return harbor_task(root, "answer", "FROM python:3.11-slim\nWORKDIR /app\nCOPY logo.png assets/logo.png\n",
                       test_sh, "#!/bin/bash\necho 42 > /app/answer.txt\n", {"environment/logo.png": PNG})  # fmt: skip


def bad_suite(root: Path) -> Path:
    """One good task and four that cannot be used, each for its own reason."""
    sound_task(root)
    noop = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"
    harbor_task(root, "copy-outside", "FROM x\nWORKDIR /app\nCOPY tool.sh /usr/local/bin/\n", noop, "",
                {"environment/tool.sh": "#!/bin/sh\n"})  # fmt: skip
    harbor_task(root, "source-outside", "FROM x\nWORKDIR /app\nCOPY ../tests/test.sh /app/\n", noop, "")
    multi = harbor_task(root, "multi-step", "FROM x\n", noop, "")
    (multi / "instruction.md").unlink()
    (multi / "task.toml").write_text(TOML + '[[steps]]\ninstruction = "a"\n[[steps]]\ninstruction = "b"\n')
    harbor_task(root, "no-tests", "FROM x\nWORKDIR /app\n", noop, "")
    (root / "no-tests" / "tests" / "test.sh").unlink()
    return root


def cfg_for(root: Path, **kw) -> TaskConfig:
    return TaskConfig(source="harbor", path=str(root), split="all", **kw)


# ---------------------------------------------------------------- skipping, strict, min_tasks (unit)


@pytest.mark.unit
def test_bad_tasks_are_skipped_and_named(tmp_path):
    suite = load_suite(cfg_for(bad_suite(tmp_path)))
    assert [t.task_id for t in suite.tasks] == ["answer"]
    causes = suite.skipped_causes()
    assert sorted(causes) == ["copy-outside", "multi-step", "no-tests", "source-outside"]
    assert "copies to /usr/local/bin, outside the working directory /app" in causes["copy-outside"]
    assert "COPY source '../tests/test.sh' is not in environment/" in causes["source-outside"]
    assert causes["multi-step"].startswith("multi-step Harbor task (2 [[steps]] in task.toml): unsupported")
    assert "no tests/test.sh" in causes["no-tests"]
    pool = TaskPool.from_config(cfg_for(tmp_path), seed=0)
    assert [t.task_id for t in pool.tasks] == ["answer"] and pool.skipped_causes() == causes


@pytest.mark.unit
def test_malformed_values_and_instance_lines_skip_only_their_task(tmp_path):
    bad_suite(tmp_path / "harbor")
    (tmp_path / "harbor" / "copy-outside" / "task.toml").write_text("environment = 3\n")
    causes = read_suite(cfg_for(tmp_path / "harbor")).skipped_causes()
    assert causes["copy-outside"].startswith("AttributeError: ")
    swe = ROOT / "examples" / "tasks" / "swebench"
    first, *rest = (swe / "instances.jsonl").read_text().splitlines()
    (tmp_path / "i.jsonl").write_text("\n".join([first, "{not json", first, json.dumps([1]), *rest]) + "\n")
    suite = read_suite(TaskConfig(source="swebench", path=str(tmp_path / "i.jsonl"), repos=str(swe / "repos")))
    assert len(suite.tasks) == 1 + len(rest)
    causes = suite.skipped_causes()
    assert (
        causes["i.jsonl:2"].startswith("not JSON: Expecting property name")
        and causes["i.jsonl:4"] == "not a JSON object"
    )
    assert causes["gyre-examples__calc-1"] == "instance id gyre-examples__calc-1 repeats line 1"


@pytest.mark.unit
def test_strict_refuses_a_suite_with_a_bad_task(tmp_path):
    bad_suite(tmp_path)
    with pytest.raises(SuiteError) as err:
        load_suite(cfg_for(tmp_path, strict=True))
    text = str(err.value)
    assert text.startswith("tasks.strict=true and 4 of 5 tasks of") and isinstance(err.value, ConfigValueError)
    for name in ("copy-outside", "multi-step", "no-tests", "source-outside"):
        assert f"  {name}: skipped: " in text
    assert load_suite(cfg_for(tmp_path / "answer", strict=True)).tasks[0].task_id == "answer"  # a sound one loads


@pytest.mark.unit
def test_too_few_usable_tasks_refuse_naming_the_causes(tmp_path):
    bad_suite(tmp_path)
    with pytest.raises(
        SuiteError, match=r"1 usable tasks in tasks.split=all, fewer than tasks.min_tasks=2 \(4 skipped"
    ):
        load_suite(cfg_for(tmp_path, min_tasks=2))
    shutil.rmtree(tmp_path / "answer")
    with pytest.raises(SuiteError) as err:  # the default floor: one usable task
        load_suite(cfg_for(tmp_path))
    assert "0 usable tasks" in str(err.value) and "copy-outside: skipped: " in str(err.value)
    with pytest.raises(ConfigValueError, match="tasks.min_tasks=0: must be >= 1"):
        cfg_for(tmp_path, min_tasks=0)


@pytest.mark.integration
def test_the_cli_refuses_with_one_message_and_no_traceback(tmp_path):
    bad_suite(tmp_path / "suite")
    args = ["tasks.source=harbor", f"tasks.path={tmp_path / 'suite'}", "tasks.split=all", "tasks.min_tasks=3",
            f"output_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "launch.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "fewer than tasks.min_tasks=3" in proc.stderr, proc.stderr
    assert "multi-step: skipped: multi-step Harbor task" in proc.stderr
    assert not (tmp_path / "run" / "shards").exists()  # nothing started


@pytest.mark.unit
def test_skipped_tasks_reach_provenance_and_the_summary(tmp_path):
    bad_suite(tmp_path)
    pool = TaskPool.from_config(cfg_for(tmp_path), seed=0)
    cfg = compose(["tasks=harbor_examples"])
    outcome = RolloutOutcome("r0", pool.tasks[0], Grade("ok", 1.0, 1, 1), 1.0, 1, "finish", False)
    prov = task_provenance(cfg, [FinishedRollout(0, outcome, [])], pool.skipped_causes())
    assert prov["skipped"] == pool.skipped_causes() and list(prov["skipped"]) == sorted(prov["skipped"])
    assert "skipped" not in task_provenance(cfg, [FinishedRollout(0, outcome, [])])  # none: as before
    text = summary([{"n_scored": 1, "success_rate": 1.0, "n_excluded": 0, "n_rollouts": 1}], tmp_path,
                   pool.skipped_causes())  # fmt: skip
    assert "gyre: task copy-outside skipped: " in text and "gyre: task multi-step skipped: " in text


@pytest.mark.unit
def test_a_compose_build_context_is_the_task_root(tmp_path):
    d = harbor_task(tmp_path, "compose", "FROM x\nWORKDIR /app\nCOPY data/input.csv input.csv\n",
                    "#!/bin/bash\n", "", {"data/input.csv": "a,b\n"})  # fmt: skip
    (d / "environment" / "Dockerfile").rename(d / "Dockerfile")
    (d / "docker-compose.yaml").write_text("services:\n  client:\n    build:\n      context: .\n")
    task = load_harbor_task(d)
    assert (
        task.files == {"input.csv": "a,b\n"}
        and task.build_context == str(d)
        and task.dockerfile == str(d / "Dockerfile")
    )
    plain = load_harbor_task(sound_task(tmp_path))
    assert plain.build_context == str(tmp_path / "answer" / "environment")


@pytest.mark.unit
def test_a_compose_files_sidecars_are_not_the_agents_environment(tmp_path):
    """Harbor's compose file adds services beside `main` (an API server, a simulated user) with builds of their
    own: the agent's environment stays environment/Dockerfile (the cookbook's multi-container, mcp-tools)."""
    d = sound_task(tmp_path)
    (d / "environment" / "api-server").mkdir()
    (d / "environment" / "api-server" / "Dockerfile").write_text("FROM python:3.11-slim\n")
    sidecar = "  api-server:\n    build:\n      context: ./api-server\n"
    for spec in (f"services:\n  main:\n    depends_on: [api-server]\n{sidecar}", f"services:\n{sidecar}"):
        (d / "environment" / "docker-compose.yaml").write_text(spec)
        task = load_harbor_task(d)
        assert task.dockerfile == str(d / "environment" / "Dockerfile"), spec
        assert task.build_context == str(d / "environment")


# ---------------------------------------------------------------- binary workspaces (unit)


@pytest.mark.unit
def test_binary_workspace_files_round_trip(tmp_path):
    task = load_harbor_task(sound_task(tmp_path / "suite"))
    assert task.files["assets/logo.png"] == PNG  # bytes, exactly
    assert (task.materialize(tmp_path / "ws") / "assets" / "logo.png").read_bytes() == PNG
    repo = tmp_path / "repos" / "acme__logo"
    repo.mkdir(parents=True)
    (repo / "logo.png").write_bytes(PNG)
    (repo / "README").write_text("text\n")
    base = commit_tree(repo)
    subprocess.run(["git", "commit", "-q", "--allow-empty", "-m", "later"], cwd=repo, env={**GIT_ENV}, check=True)
    row = {"instance_id": "acme__logo-1", "repo": "acme/logo", "base_commit": base, "problem_statement": "p",
           "test_patch": "", "FAIL_TO_PASS": [], "PASS_TO_PASS": []}  # fmt: skip
    (tmp_path / "instances.jsonl").write_text(json.dumps(row) + "\n")
    (inst,) = load_swebench_tasks(tmp_path / "instances.jsonl")
    assert inst.files == {"logo.png": PNG, "README": "text\n"}
    assert (inst.materialize(tmp_path / "ws2") / "logo.png").read_bytes() == PNG


@pytest.mark.unit
def test_an_oversized_workspace_is_reported_not_a_crash(tmp_path, monkeypatch):
    bad_suite(tmp_path)
    monkeypatch.setattr(task_module, "MAX_WORKSPACE_BYTES", 200)
    suite = read_suite(cfg_for(tmp_path))
    cause = suite.skipped_causes()["answer"]
    assert "the initial workspace is 0.3 KiB, over the 0.2 KiB limit" in cause and "assets/logo.png" in cause
    with pytest.raises(TaskFormatError, match="largest: assets/logo.png"):
        load_harbor_task(tmp_path / "answer")


# ---------------------------------------------------------------- the oracle check


@pytest.mark.unit
def test_logs_are_named_in_words():
    assert "needs the network" in name_cause("urllib.error.URLError: <urlopen error [Errno -3] Temporary failure "
                                             "in name resolution>")  # fmt: skip
    assert "needs the network" in name_cause("curl: (6) Could not resolve host: astral.sh")
    assert "needs pytest" in name_cause("/usr/bin/python3: No module named pytest")
    said = name_cause("OSError: [Errno 30] Read-only file system: '/tests/score.txt'")
    assert "writes /tests/score.txt" in said and "read-only" in said
    # pytest reported: the test script's offline setup (apt-get, the uv installer) is not the cause, nor is
    # pytest's own cache under /tests; a wrong answer is left to the failed tests
    ran = ("curl: (6) Could not resolve host: astral.sh\n/tests/test.sh: line 6: curl: command not found\n"
           "W: Problem unlinking the file /var/cache/apt/pkgcache.bin - RemoveCaches (30: Read-only file system)\n"
           "could not create cache path: [Errno 30] Read-only file system: '/tests/pytest-cache-files-x1'\n"
           "=================== 4 failed, 1 passed, 2 warnings in 0.22s ====================\n")  # fmt: skip
    assert name_cause(ran) == ""
    forged = ran + "PermissionError: [Errno 13] Permission denied: '/logs/verifier/reward.json'\n"
    assert "reward guard" in name_cause(forged)  # the cookbook's multi-reward writes it from python3 -c
    # the guard acts only in the grade itself: its failed grade's output names the cause first
    causes = _causes(Grade.failed("the evaluation broke: ...\n" + forged), Grade.failed("x"), "", "")
    assert causes[0].startswith("the oracle's grade failed: the test run writes its reward file from a program")
    assert "writes /tests/score.txt" in name_cause(ran + "OSError: Read-only file system: '/tests/score.txt'\n")
    assert "needs pytest" in name_cause("tests/test.sh: line 3: uvx: command not found")
    assert name_cause("ModuleNotFoundError: No module named 'numpy'").startswith("needs the Python module numpy")
    assert name_cause("bash: jq: command not found") == "needs `jq`, which the environment it runs in lacks"
    assert name_cause("AssertionError: assert 41 == 42") == ""


@pytest.fixture(scope="module")
def sandbox():
    return make_sandbox(SandboxConfig())


@pytest.mark.integration
def test_check_tasks_json_sound_broken_and_unloadable(tmp_path):
    suite = tmp_path / "suite"
    sound_task(suite)
    shutil.copytree(BROKEN / "nop-passes", suite / "nop-passes")
    harbor_task(suite, "copy-outside", "FROM x\nWORKDIR /app\nCOPY tool.sh /usr/local/bin/\n", "#!/bin/bash\n", "",
                {"environment/tool.sh": "#!/bin/sh\n"})  # fmt: skip
    out = tmp_path / "verdicts.json"
    assert check_tasks.main([str(suite), "--jobs", "2", "--json", str(out)]) == 1
    rows = {r["task"]: r for r in json.loads(out.read_text())}
    assert all(list(r) == ["task", "built", "oracle", "noop", "verdict", "cause"] for r in rows.values())
    assert rows["answer"] == {"task": "answer", "built": None, "oracle": 1.0, "noop": 0.0, "verdict": "sound",
                              "cause": ""}  # fmt: skip
    assert rows["nop-passes"]["verdict"] == "broken" and rows["nop-passes"]["noop"] == 1.0
    assert rows["nop-passes"]["cause"] == "the do-nothing agent gets the full reward"
    skipped = rows["copy-outside"]
    assert (skipped["verdict"], skipped["built"], skipped["oracle"], skipped["noop"]) == ("skipped", None, None, None)
    assert "outside the working directory /app" in skipped["cause"]
    assert check_tasks.main([str(suite / "answer")]) == 0


@pytest.mark.integration
def test_broken_tasks_say_why_with_the_output(tmp_path, sandbox):
    offline = "import urllib.request; urllib.request.urlopen('http://example.com', timeout=5)"
    net = harbor_task(tmp_path, "needs-net", "FROM x\nWORKDIR /app\n",
                      f"#!/bin/bash\npython3 -c \"{offline}\" && echo 1 > /logs/verifier/reward.txt || "
                      "echo 0 > /logs/verifier/reward.txt\n",
                      "#!/bin/bash\necho 42 > /app/answer.txt\n")  # fmt: skip
    report = check_task(load_harbor_task(net), sandbox)
    assert report.verdict == "broken" and report.oracle.score == 0.0
    assert report.problem.startswith("the oracle gets 0, not the full reward 1: the test run needs the network")
    assert "name resolution" in report.test_output or "Errno" in report.test_output
    uvx = harbor_task(tmp_path, "uvx", "FROM x\nWORKDIR /app\n",
                      "#!/bin/bash\nuvx -w pytest==8.4.1 pytest /tests/test_outputs.py && echo 1 > "
                      "/logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n", "#!/bin/bash\n")  # fmt: skip
    assert "needs pytest (or uv)" in check_task(load_harbor_task(uvx), sandbox).problem
    wrong = harbor_task(tmp_path, "wrong", "FROM x\nWORKDIR /app\n",
                        "#!/bin/bash\necho 'expected 43' ; [ \"$(cat /app/answer.txt)\" = 43 ] && r=1 || r=0\n"
                        "echo $r > /logs/verifier/reward.txt\n", "#!/bin/bash\necho 42 > /app/answer.txt\n")  # fmt: skip
    report = check_task(load_harbor_task(wrong), sandbox)
    assert "wrong answer" in report.problem and "expected 43" in report.test_output
    both = harbor_task(tmp_path, "both", "FROM x\nWORKDIR /app\n", "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
                       f"#!/bin/bash\npython3 -c \"{offline}\"\n")  # fmt: skip
    report = check_task(load_harbor_task(both), sandbox)
    assert report.causes[0].startswith("solve.sh exited 1: the solution needs the network")
    assert report.causes[-1] == "the do-nothing agent gets the full reward"  # named although the solution failed
    assert "solution output ends" in report.line() and "name resolution" in report.solution_output


# ---------------------------------------------------------------- real SWE-bench instances (integration)


@pytest.mark.integration
def test_real_swebench_instances_are_sound_under_bwrap(sandbox):
    """pallets__flask-4992, -5014, -5063 and marshmallow-code__marshmallow-1359 at their base commits (PNGs in the
    trees), graded with their FAIL_TO_PASS / PASS_TO_PASS lists: the reference patch gets 1, the untouched
    repository 0."""
    rows = [json.loads(line) for line in REAL.read_text().splitlines()]
    tasks = load_swebench_tasks(REAL)
    assert [t.task_id for t in tasks] == ["pallets__flask-4992", "pallets__flask-5014", "pallets__flask-5063",
                                          "marshmallow-code__marshmallow-1359"]  # fmt: skip
    logos = ["docs/_static/flask-logo.png"] * 3 + ["docs/_static/marshmallow-logo.png"]
    for task, logo in zip(tasks, logos, strict=True):
        assert task.files[logo][:8] == b"\x89PNG\r\n\x1a\n"  # kept as bytes
    with ThreadPoolExecutor(2) as pool:
        reports = list(pool.map(lambda t: check_task(t, sandbox, check_timeout_s=120.0), tasks))
    for row, report in zip(rows, reports, strict=True):
        assert (report.verdict, report.oracle.score, report.nop.score) == ("sound", 1.0, 0.0), report.line()
        n_tests = len(json.loads(row["FAIL_TO_PASS"])) + len(json.loads(row["PASS_TO_PASS"]))
        assert report.oracle.total == n_tests and report.oracle.passed == n_tests
