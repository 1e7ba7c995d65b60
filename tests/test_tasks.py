"""Task suite: sampling, demonstrations replayed through the harness's tools, grading outcomes."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from gyre.config.schema import HarnessConfig, TaskConfig
from gyre.harness.demos import demonstration, tokenizer_corpus
from gyre.harness.tools import TOOL_SCHEMAS, execute_tool
from gyre.model.chat_template import assistant_body, render_text
from gyre.model.tokenizer import Tokenizer
from gyre.tasks.checker_report import CheckerReport
from gyre.tasks.families import FAMILIES, echo_files_task, fix_value_task, write_value_task
from gyre.tasks.grading import _grade_from, grade_workspace
from gyre.tasks.suite import TaskPool, sample_tasks
from gyre.tasks.swebench_checker import read_records, refuse_loaded_files, runner_files
from gyre.tasks.task import Task

pytestmark = pytest.mark.unit
ALL_FAMILIES = sorted(FAMILIES)  # the suite as a whole; the embedded default uses a subset


def replay(task: Task, workspace) -> list[str]:
    """Execute a demonstration's tool calls with the harness's tool code; return the tool texts."""
    task.materialize(workspace)
    texts = []
    for message in demonstration(task).messages:
        for call in message.get("tool_calls") or []:
            fn = call["function"]
            result = execute_tool(workspace, fn["name"], fn["arguments"], task.visible_checks)
            assert not result.error, result.text
            if result.finished:
                return texts
            texts.append(result.text)
    raise AssertionError("demonstration never called finish")


def test_sampling_is_deterministic_and_varied():
    a = sample_tasks(ALL_FAMILIES, 300, seed=7)
    assert [t.to_dict() for t in a] == [t.to_dict() for t in sample_tasks(ALL_FAMILIES, 300, seed=7)]
    assert [t.task_id for t in a] != [t.task_id for t in sample_tasks(ALL_FAMILIES, 300, seed=8)]
    assert len({t.task_id for t in a}) >= 250  # write_value has 144 instances; the others are combinatorial
    assert set(Counter(t.family for t in a)) == set(ALL_FAMILIES)
    assert set(TaskConfig().families) <= set(FAMILIES)
    n_files = Counter(len(t.checks) for t in a if t.family == "echo_files")
    assert set(n_files) == {1, 2, 3, 4, 5} and n_files[1] > n_files[5]
    assert all(t.max_turns == len(t.solution) + 2 for t in a)
    assert Task.from_dict(json.loads(json.dumps(a[0].to_dict()))) == a[0]


def test_harness_view_hides_the_checks():
    view = sample_tasks(["fix_value"], 1, seed=0)[0].harness_view()
    assert set(view) == {"task_id", "prompt", "visible_checks"}


def test_unknown_family_names_the_known_ones():
    with pytest.raises(KeyError, match="write_value"):
        sample_tasks(["nope"], 1, seed=0)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_demonstrations_replay_to_full_score(family, tmp_path):
    for i, task in enumerate(sample_tasks([family], 4, seed=11)):
        workspace = tmp_path / str(i)
        tool_texts = replay(task, workspace)
        expected = [m["content"] for m in demonstration(task).messages if m["role"] == "tool"]
        assert tool_texts == expected  # demos show exactly what the harness would
        grade = grade_workspace(task, workspace)
        assert (grade.status, grade.score, grade.success) == ("ok", 1.0, True), grade


def test_demonstration_shape():
    messages, tools = demonstration(write_value_task("answer.txt", "apple"))
    assert tools == TOOL_SCHEMAS
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert json.loads(messages[2]["tool_calls"][0]["function"]["arguments"]) == {
        "path": "answer.txt",
        "content": "apple",
    }
    assert messages[-1]["tool_calls"][0]["function"]["name"] == "finish"


def test_demonstration_turns_fit_the_token_budget():
    """Every assistant reply fits the harness's max_tokens with a tokenizer trained on the corpus."""
    tokenizer = Tokenizer.train(tokenizer_corpus(600, seed=0), vocab_size=1024)
    budget = HarnessConfig().max_tokens
    longest = 0
    for task in sample_tasks(ALL_FAMILIES, 200, seed=1):
        messages, tools = demonstration(task)
        longest = max(
            [longest] + [len(tokenizer.encode(assistant_body(m))) for m in messages if m["role"] == "assistant"]
        )
        assert len(tokenizer.encode(render_text(messages, tools))) < 600
    assert longest <= budget


def test_tokenizer_corpus_is_deterministic():
    a = list(tokenizer_corpus(5, seed=3))
    assert a == list(tokenizer_corpus(5, seed=3)) and len(a) == 5
    assert all("<tool_call>" in text and "run_checks" in text and "<|im_start|>tool" in text for text in a)


def test_partial_credit_for_echo_files(tmp_path):
    task = echo_files_task({"a.txt": "red", "b.txt": "cat", "c.txt": "sun"})
    (tmp_path / "a.txt").write_text("red\n")
    (tmp_path / "b.txt").write_text("cat")
    (tmp_path / "c.txt").write_text("moon")
    grade = grade_workspace(task, tmp_path)
    assert (grade.status, grade.passed, grade.total, grade.success) == ("ok", 2, 3, False)
    assert grade.score == pytest.approx(2 / 3)
    assert [c["passed"] for c in grade.checks] == [True, True, False]


def test_fix_value_checks(tmp_path):
    task = fix_value_task("config.py", {"LIMIT": 3, "DEBUG": False, "SIZE": 7}, "LIMIT", 8)
    ws = task.materialize(tmp_path / "ws")
    cases = {
        "LIMIT = 8\nDEBUG = False\nSIZE = 7\n": 2,  # fixed
        "SIZE = 7\nLIMIT = 8\n\nDEBUG = False\n": 1,  # value right, other lines reordered
        "LIMIT = 3\nDEBUG = False\nSIZE = 7\n": 0,  # untouched: keeping the other lines earns nothing alone
        "LIMIT = 8)\nDEBUG = False\nSIZE = 7\n": 0,  # syntax error
        "LIMIT = '8'\nDEBUG = False\nSIZE = 7\n": 0,  # a string is not the int 8
    }
    for content, passed in cases.items():
        (ws / "config.py").write_text(content)
        grade = grade_workspace(task, ws)
        assert (grade.status, grade.passed, grade.total) == ("ok", passed, 2), (content, grade)
    assert grade.checks[1]["detail"] == "needs LIMIT == 8"


def test_hanging_workspace_code_fails_its_check_not_the_evaluation(tmp_path):
    task = fix_value_task("config.py", {"LIMIT": 3, "DEBUG": False}, "LIMIT", 8)
    ws = task.materialize(tmp_path / "ws")
    (ws / "config.py").write_text("LIMIT = 8\nDEBUG = False\nwhile True:\n    pass\n")
    grade = grade_workspace(task, ws, check_timeout_s=6.0)  # the checker itself needs headroom on a busy machine
    assert (grade.status, grade.passed, grade.total) == ("ok", 0, 2)
    assert "timed out" in grade.checks[0]["detail"]


@pytest.mark.parametrize("backend", ["none", "bwrap"])
def test_workspace_programs_cannot_make_the_checker_time_out(backend, tmp_path):
    """Four checked programs that hang or leave a child holding the checker's pipes: if together they
    could outlast the checker's limit, the grade would be a failed evaluation, and a losing rollout
    would be excluded instead of scored 0. They fail their checks within the checker's limit."""
    from gyre.config.schema import SandboxConfig
    from gyre.sandbox import make_sandbox

    forks = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(15)\nX = 1\n"
    programs = {"forks.py": forks, **{f"hang{i}.py": "X = 1\nwhile True:\n    pass\n" for i in range(3)}}
    for name, text in programs.items():
        (tmp_path / name).write_text(text)
    checks = [{"name": n, "kind": "python_value", "path": n, "var": "X", "value": 1} for n in programs]
    sandbox = make_sandbox(SandboxConfig(backend=backend))
    grade = grade_workspace(Task("t", "custom", "p", checks=checks), tmp_path, check_timeout_s=6.0, sandbox=sandbox)
    assert (grade.status, grade.score, grade.passed, grade.total) == ("ok", 0.0, 0, 4), grade
    assert "timed out" in grade.checks[0]["detail"]
    assert "used up the checker's time" in grade.checks[-1]["detail"]


def test_a_huge_checked_file_is_not_read_whole(tmp_path):
    task = echo_files_task({"a.txt": "red", "b.txt": "cat"})
    (tmp_path / "a.txt").write_text("red" + " " * (2 << 20))  # equal after strip(), but past MAX_READ_BYTES
    (tmp_path / "b.txt").write_text("cat")
    grade = grade_workspace(task, tmp_path)
    assert (grade.status, grade.passed, grade.total) == ("ok", 1, 2), grade


def test_timed_out_rollout_is_still_graded(tmp_path):
    task = echo_files_task({"a.txt": "red", "b.txt": "cat"})
    (tmp_path / "a.txt").write_text("red")
    grade = grade_workspace(task, tmp_path, timed_out=True)
    assert (grade.status, grade.score, grade.success) == ("timeout", 0.5, False)


def test_crashing_checker_is_a_failed_evaluation(tmp_path):
    task = Task("t", "custom", "p", checker_source="raise RuntimeError('checker exploded')\n")
    grade = grade_workspace(task, tmp_path)
    assert (grade.status, grade.score, grade.success) == ("failed", None, False)
    assert "checker exploded" in grade.reason


def test_unknown_check_kind_is_a_failed_evaluation(tmp_path):
    task = Task("t", "custom", "p", checks=[{"name": "x", "kind": "teleport"}])
    grade = grade_workspace(task, tmp_path)
    assert grade.status == "failed" and "teleport" in grade.reason


def test_garbage_checker_output_is_a_failed_evaluation(tmp_path):
    grade = grade_workspace(Task("t", "custom", "p", checker_source="print('all good')\n"), tmp_path)
    assert grade.status == "failed" and grade.score is None and "unreadable" in grade.reason


def test_hanging_checker_fails_after_check_timeout(tmp_path):
    task = Task("t", "custom", "p", checker_source="import time\ntime.sleep(600)\n")
    start = time.monotonic()
    grade = grade_workspace(task, tmp_path, check_timeout_s=0.5)
    assert time.monotonic() - start < 3.0
    assert (grade.status, grade.score) == ("failed", None) and "timed out" in grade.reason


def test_missing_workspace_is_a_failed_evaluation(tmp_path):
    grade = grade_workspace(write_value_task("answer.txt", "apple"), tmp_path / "gone")
    assert grade.status == "failed" and grade.score is None and "does not exist" in grade.reason


def test_attribution_follows_the_checkers_report_not_its_exit_code():
    """Once the checker has said the agent's code starts, no verdict is the agent's failure whatever the
    exit (any signal, a stop, a plain exit code, an evaluation that broke); before that it is a failed grade;
    a verdict stands."""
    verdict = json.dumps({"results": [{"name": "a", "passed": True}]})
    for code in (0, -9, 137, None):  # a verdict stands however the checker ended afterwards
        assert _grade_from(code, "", CheckerReport(True, verdict), False, 5.0).status == "ok"
    cases = {-10: "checker_killed", 138: "checker_killed", 130: "checker_killed", None: "checker_stopped",
             1: "grading_interrupted", 0: "grading_interrupted"}  # fmt: skip
    for code, reason in cases.items():
        grade = _grade_from(code, "boom", CheckerReport(agent_code_started=True), False, 5.0)
        assert (grade.status, grade.score) == ("agent_failed", 0.0) and grade.reason.startswith(reason + ":"), grade
        assert _grade_from(code, "boom", CheckerReport(), False, 5.0).status == "failed"
    # the evaluation broke before the agent's code ran (a test patch that does not apply): excluded
    broken = _grade_from(3, "", CheckerReport(False, None, "test_patch does not apply"), False, 5.0)
    assert (broken.status, broken.score) == ("failed", None) and "test_patch does not apply" in broken.reason
    # once it had run (no reward file after the tests): the agent's failure, since its code may be why
    after = _grade_from(3, "", CheckerReport(True, None, "no reward file"), False, 5.0)
    assert (after.status, after.score) == ("agent_failed", 0.0) and after.reason.startswith("grading_interrupted:")
    assert "no reward file" in after.reason


def test_swebench_statuses_come_from_complete_runner_records(tmp_path):
    def write(name, record):
        (tmp_path / name).write_text(json.dumps(record))

    assert read_records(tmp_path, "unittest")[1].startswith("tests_incomplete: no unittest run")
    write("unittest-7-0.json", {"runner": "unittest", "complete": True, "status": {"a": "FAILED", "b": "PASSED"}})
    write("unittest-zzz.json", {"runner": "unittest", "complete": True, "status": {"a": "PASSED", "c": "PASSED"}})
    assert read_records(tmp_path, "unittest") == ({"a": "FAILED", "b": "PASSED", "c": "PASSED"}, None)
    write("unittest-8-1.json", {"runner": "unittest", "complete": False})  # a run ended early (os._exit)
    assert read_records(tmp_path, "unittest")[1].startswith("tests_incomplete: a unittest run ended")
    (tmp_path / "unittest-8-1.json").write_text("not json")
    assert read_records(tmp_path, "unittest")[1].startswith("tests_incomplete:")


def test_custom_checker_results_are_used(tmp_path):
    source = (
        "import json\nprint(json.dumps({'results': [{'name': 'a', 'passed': True}, {'name': 'b', 'passed': False}]}))\n"
    )
    grade = grade_workspace(Task("t", "custom", "p", checker_source=source), tmp_path)
    assert (grade.status, grade.passed, grade.total) == ("ok", 1, 2)


@pytest.mark.unit
def test_task_pool_visits_every_instance_once_per_epoch():
    pool = TaskPool(["write_value", "echo_files"], size=8, seed=3)
    epoch0 = [t.task_id for s in range(2) for t in pool.for_step(s, 4)]
    epoch1 = [t.task_id for s in range(2, 4) for t in pool.for_step(s, 4)]
    ids = sorted(t.task_id for t in pool.tasks)
    assert sorted(epoch0) == ids and sorted(epoch1) == ids
    assert epoch0 != epoch1  # each epoch reshuffled
    assert [t.task_id for t in pool.for_step(5, 4)] == [t.task_id for t in pool.for_step(5, 4)]


@pytest.mark.unit
def test_task_pool_size_zero_draws_fresh_tasks_and_negative_is_refused():
    pool = TaskPool(["write_value"], size=0, seed=1)
    assert [t.task_id for t in pool.for_step(0, 3)] != [t.task_id for t in pool.for_step(1, 3)]
    with pytest.raises(ValueError, match="pool_size"):
        TaskPool(["write_value"], size=-1, seed=1)


@pytest.mark.unit
def test_task_pool_holds_every_family_in_equal_shares_whatever_the_seed():
    for seed in range(5):
        pool = TaskPool(["write_value", "echo_files"], size=8, seed=seed)
        assert Counter(t.family for t in pool.tasks) == {"write_value": 4, "echo_files": 4}


def test_swebench_grading_keeps_the_original_trees_metadata_and_runner_modules(tmp_path):
    """What pytest loads of its own accord from the workspace: distributions' metadata the agent added (a pytest11
    entry point is a plugin) goes, the original's entry_points.txt comes back as it was; a top-level module the
    runner imports (packaging) the agent added goes; the original tree's own files stay."""
    original = {"pkg/__init__.py": "", "pkg.egg-info/entry_points.txt": "[console_scripts]\npkg = pkg:main\n"}
    for rel, text in original.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "pkg.egg-info" / "entry_points.txt").write_text("[pytest11]\nevil = evilplug\n")
    for rel in ("evil-1.0.dist-info/entry_points.txt", "other.egg-info/PKG-INFO", "packaging/__init__.py",
                "evilplug.py"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x\n")
    removed = refuse_loaded_files(tmp_path, set(original), runner_files(original), {"."})
    assert {"evil-1.0.dist-info", "other.egg-info", "packaging"} <= set(removed)
    assert (tmp_path / "pkg.egg-info" / "entry_points.txt").read_text() == original["pkg.egg-info/entry_points.txt"]
    assert (tmp_path / "pkg" / "__init__.py").is_file() and (tmp_path / "evilplug.py").is_file()  # the agent's own
    assert not (tmp_path / "evil-1.0.dist-info").exists() and not (tmp_path / "packaging").exists()
