"""Harness presets (conf/harness/): each runs a step of the main job end to end with scored rollouts; a harness
the model cannot serve fails before the first step; demonstrations render as the real proxy renders requests."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.config.load import compose
from gyre.config.validate import ConfigValueError
from gyre.harness.formats import claude_code_demonstration
from gyre.harness.kinds import harness_spec
from gyre.harness.preflight import check_harness_fits
from gyre.metrics import read_metrics
from gyre.model.chat_template import GENERATION_PROMPT, render_text
from gyre.model.tokenizer import Tokenizer
from gyre.sched.controller.report import step_rows
from gyre.tasks.suite import TaskPool, sample_tasks
from gyre.warm_start import encode_conversation, harness_corpus

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["tokenizer.corpus_tasks=40", "tokenizer.vocab_size=512"]
TOY_RUN = [  # colocate: one step's run of a preset in one process (the default is elastic)
    "scheduler=colocate", "steps=1", "rl.groups_per_step=1", "rl.group_size=2", "warm_start.steps=2", "warm_start.demos=8",
    "warm_start.batch_size=4", *SMALL,
]  # fmt: skip


@pytest.fixture(scope="module")
def claude_tokenizer() -> Tokenizer:
    cfg = compose(["harness=claude_code", *SMALL])
    return Tokenizer.train(harness_corpus(cfg), cfg.tokenizer.vocab_size)


@pytest.mark.unit
def test_presets_compose():
    for name in ("builtin", "claude_code", "mini_swe_agent", "codex"):
        cfg = compose([f"harness={name}"])
        assert cfg.harness.kind == name
    cc = compose(["harness=claude_code"])
    assert cc.harness.bare and cc.proxy.max_output_tokens and cc.engine.max_context_tokens == 4096
    assert compose(["harness=mini_swe_agent"]).harness.bare and compose(["harness=codex"]).harness.bare
    with pytest.raises(ConfigValueError, match="harness.bare"):
        compose(["harness=builtin", "harness.bare=true"])


@pytest.mark.unit
def test_full_claude_code_does_not_fit_the_default_context(claude_tokenizer):
    tasks = sample_tasks(["write_value"], 2, seed=0)
    assert check_harness_fits(compose(["harness=claude_code", *SMALL]), tasks, claude_tokenizer) < 400
    full = compose(["harness=claude_code", "harness.bare=false", *SMALL])
    with pytest.raises(ConfigValueError) as e:
        check_harness_fits(full, tasks, claude_tokenizer)
    for key in ("engine.max_context_tokens", "proxy.max_context_tokens", "model.max_position_embeddings", "bare"):
        assert key in str(e.value)


@pytest.mark.unit
def test_claude_code_demonstration_is_bash_tool_use_then_done(claude_tokenizer):
    (task,) = sample_tasks(["write_value"], 1, seed=3)
    demo = claude_code_demonstration(task, bare=True, date="2026-03-04")
    path, word = task.solution[0]["arguments"]["path"], task.solution[0]["arguments"]["content"]
    assert [t["function"]["name"] for t in demo.tools] == ["Bash", "Edit", "Read"]
    assert task.prompt in demo.messages[1]["content"] and "2026-03-04" in demo.messages[0]["content"]
    (call,) = demo.messages[2]["tool_calls"]
    assert call["function"] == {"name": "Bash", "arguments": {"command": f"printf %s {word} > {path}"}}
    assert demo.messages[3] == {
        "role": "tool",
        "tool_call_id": "toolu_demo_0",
        "content": "(Bash completed with no output)",
    }
    assert demo.messages[4]["content"] == "Done."
    ids, mask = encode_conversation(demo.messages, demo.tools, claude_tokenizer)
    assert len(ids) == len(mask) and 0 < sum(mask) < len(ids)
    assert render_text(*harness_spec("claude_code").first_request(task)) in render_text(
        *harness_spec("claude_code").demonstration(task)
    )


@pytest.mark.unit
def test_codex_demonstration_is_exec_command_calls_then_done_and_its_full_prompt_does_not_fit():
    (task,) = sample_tasks(["echo_files"], 1, seed=5)
    demo = harness_spec("codex").demonstration(task, bare=True)
    writes = [c["arguments"] for c in task.solution if c["name"] == "write_file"]
    assert [t["function"]["name"] for t in demo.tools] == ["exec_command", "write_stdin", "request_user_input"]
    assert [m["role"] for m in demo.messages[:2]] == ["system", "user"] and demo.messages[1]["content"] == task.prompt
    calls = [m["tool_calls"][0]["function"] for m in demo.messages if m.get("tool_calls")]
    assert calls == [{"name": "exec_command", "arguments": json.dumps({"cmd": f"printf %s {a['content']} > {a['path']}"})}
                     for a in writes]  # fmt: skip
    assert demo.messages[3]["role"] == "tool" and "Process exited with code 0" in demo.messages[3]["content"]
    assert demo.messages[-1] == {"role": "assistant", "content": "Done."}
    first = harness_spec("codex").first_request(task, bare=True)
    assert render_text(*first) in render_text(*demo)
    full = harness_spec("codex").first_request(task, bare=False)  # Codex's ~17 KB of instructions and its context
    assert len(full.messages[0]["content"]) > 10_000 and "<environment_context>" in full.messages[1]["content"]
    cfg = compose(["harness=codex", *SMALL])
    tok = Tokenizer.train(harness_corpus(cfg), 512)
    assert check_harness_fits(cfg, [task], tok) < 400
    with pytest.raises(ConfigValueError, match="harness.bare=true"):
        check_harness_fits(dataclasses.replace(cfg, harness=dataclasses.replace(cfg.harness, bare=False)), [task], tok)


@pytest.mark.unit
def test_an_impossible_context_fails_before_the_first_step(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launch.run", "harness=claude_code", "harness.bare=false", *TOY_RUN,
         f"warm_start.cache_dir={tmp_path / 'cache'}", f"output_dir={tmp_path / 'run'}",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "its first request is" in proc.stderr and "engine.max_context_tokens=4096" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert "warm start done" not in proc.stdout and not (tmp_path / "run" / "metrics.jsonl").exists()


def run_preset(tmp_path: Path, preset: str, *extra: str) -> tuple[Path, list[dict]]:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.run", f"harness={preset}", *TOY_RUN, *extra,
         f"warm_start.cache_dir={tmp_path / 'cache'}", f"output_dir={out}", f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nan" not in proc.stdout.split("gyre: success rate")[-1]
    rows = step_rows(read_metrics(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0] and rows[0]["n_rollouts"] == 2
    assert rows[0]["n_scored"] == 2, rows[0]["excluded_reason_counts"]
    return out, rows


@pytest.mark.integration
def test_claude_code_preset_runs_a_step_and_its_prompts_are_the_demonstrations(tmp_path):
    out, rows = run_preset(tmp_path, "claude_code")
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert calls and all(c["api"] == "anthropic" for c in calls)
    # each rollout's first request, as the real proxy tokenized what the CLI sent, is the warm start's rendering
    (policy,) = (tmp_path / "cache").glob("policy-*")
    tok = Tokenizer.load(policy / "tokenizer")
    cfg = compose(["harness=claude_code"])
    (task,) = TaskPool(cfg.tasks.families, cfg.tasks.pool_size, seed=cfg.seed).for_step(0, 1)
    ids, _ = encode_conversation(*harness_spec("claude_code").first_request(task), tok)
    ids += tok.encode(GENERATION_PROMPT)
    for rollout in ("s0-g0-r0", "s0-g0-r1"):
        first = min((c for c in calls if c["rollout_id"] == rollout), key=lambda c: c["call_id"])
        assert first["input_ids"] == ids, (tok.decode(first["input_ids"]), tok.decode(ids))


@pytest.mark.integration
def test_mini_swe_agent_preset_runs_a_step_through_its_bash_blocks(tmp_path):
    out, rows = run_preset(tmp_path, "mini_swe_agent")
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert calls and all(c["api"] == "openai" for c in calls)
    (policy,) = (tmp_path / "cache").glob("policy-*")
    tok = Tokenizer.load(policy / "tokenizer")
    cfg = compose(["harness=mini_swe_agent"])
    (task,) = TaskPool(cfg.tasks.families, cfg.tasks.pool_size, seed=cfg.seed).for_step(0, 1)
    ids, _ = encode_conversation(*harness_spec("mini_swe_agent").first_request(task, bare=cfg.harness.bare), tok)
    ids += tok.encode(GENERATION_PROMPT)
    for rollout in ("s0-g0-r0", "s0-g0-r1"):
        first = min((c for c in calls if c["rollout_id"] == rollout), key=lambda c: c["call_id"])
        assert first["input_ids"] == ids, (tok.decode(first["input_ids"]), tok.decode(ids))


@pytest.mark.unit
@pytest.mark.parametrize("bare", [True, False])
def test_mini_swe_agent_demonstration_is_bash_blocks_then_submit(bare):
    (task,) = sample_tasks(["echo_files"], 1, seed=5)
    demo = harness_spec("mini_swe_agent").demonstration(task, bare=bare)
    writes = [c["arguments"] for c in task.solution if c["name"] == "write_file"]
    assert demo.tools == [] and [m["role"] for m in demo.messages[:2]] == ["system", "user"]
    assert task.prompt in demo.messages[1]["content"]
    replies = [m["content"] for m in demo.messages if m["role"] == "assistant"]
    assert len(replies) == len(writes) + 1
    for reply, args in zip(replies, writes, strict=False):
        assert f"```mswea_bash_command\nprintf %s {args['content']} > {args['path']}\n```" in reply
    assert replies[-1].endswith("```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```")
    assert demo.messages[3]["content"] == "<returncode>0</returncode>\n<output>\n</output>"
    # the compact templates: the task first, the submit command named, several times shorter than the stock's
    prompt = len(demo.messages[0]["content"] + demo.messages[1]["content"])
    assert (prompt < 400 and demo.messages[1]["content"].startswith(task.prompt)) if bare else prompt > 2500
    assert "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in demo.messages[1]["content"]
    with pytest.raises(ValueError, match="warm_start.families"):
        harness_spec("mini_swe_agent").demonstration(sample_tasks(["fix_value"], 1, seed=0)[0])


@pytest.mark.unit
def test_mini_swe_agent_runs_under_its_own_venv(tmp_path):
    from gyre.config.schema import SandboxConfig
    from gyre.harness.kinds import HarnessLaunch, mini_swe_agent_command
    from gyre.harness.mini_swe_agent import venv_python
    from gyre.sandbox import make_sandbox
    from gyre.sandbox.base import GYRE_ROOT, SOURCE_ROOT

    assert harness_spec("mini_swe_agent").python(make_sandbox(SandboxConfig())) == venv_python(GYRE_ROOT)
    assert harness_spec("mini_swe_agent").python(make_sandbox(SandboxConfig(backend="none"))) == venv_python(
        SOURCE_ROOT
    )
    launch = HarnessLaunch("http://127.0.0.1:1/v1", "r", tmp_path, tmp_path / "t", tmp_path / "r", 3, 32, 0.7, 0.0)
    argv = mini_swe_agent_command(launch)
    assert argv[1:3] == ["-m", "gyre.harness.mini_swe_agent"] and argv[-4:] == [
        "--max-tokens",
        "32",
        "--temperature",
        "0.7",
    ]
    assert mini_swe_agent_command(dataclasses.replace(launch, bare=True))[-5:] == [*argv[-4:], "--bare"]


@pytest.mark.unit
def test_each_harness_has_its_own_warm_start():
    from gyre.warm_start import cache_key

    keys = {cache_key(compose([f"harness={name}"])) for name in ("builtin", "claude_code", "mini_swe_agent", "codex")}
    keys.add(cache_key(compose(["harness=claude_code", "harness.bare=false"])))
    keys.add(cache_key(compose(["harness=mini_swe_agent", "harness.bare=false"])))
    keys.add(cache_key(compose(["harness=codex", "harness.bare=false"])))
    assert len(keys) == 7


@pytest.mark.unit
def test_every_configurable_harness_kind_is_one_object_in_the_registry():
    from gyre.config.schema import HarnessKind
    from gyre.harness.kinds import HARNESSES

    assert set(HARNESSES) == set(HarnessKind)
    assert all(spec.name == name for name, spec in HARNESSES.items())
    assert {k for k, spec in HARNESSES.items() if spec.short_prompt} == {"claude_code", "mini_swe_agent", "codex"}
    assert [k for k, spec in HARNESSES.items() if spec.own_max_tokens] == ["claude_code", "codex"]
    with pytest.raises(ValueError, match="unknown harness kind 'aider'"):
        harness_spec("aider")
    env = harness_spec("claude_code").env("k", "/h", {"CLAUDE_X": "1", "GYRE_CLAUDE_TRACE": "/t", "HOME": "/r"})
    assert env == {"GYRE_API_KEY": "k", "CLAUDE_X": "1", "GYRE_CLAUDE_TRACE": "/h/claude.trace"}
    assert harness_spec("builtin").env("k", "/h", {"CLAUDE_X": "1"}) == {"GYRE_API_KEY": "k"}
