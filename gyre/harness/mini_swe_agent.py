"""mini-swe-agent (PyPI `mini-swe-agent`, pinned) as a black-box harness, offline, against the proxy.

The runner starts `<mini-swe-agent's venv>/bin/python -m gyre.harness.mini_swe_agent ...` (the venv is
`.gyre/mini-swe-agent`, installed by tools/setup_env.sh, read-only in the sandbox). This wrapper runs the
stock text-based agent (minisweagent.config mini_textbased.yaml: a THOUGHT and one ```mswea_bash_command
block per reply, each command run in a fresh shell in the workspace, done when a command prints
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT) through litellm's OpenAI path against the proxy, then writes the
runner's result file. Offline: litellm reads its bundled cost map (LITELLM_LOCAL_MODEL_COST_MAP) and sends
no telemetry, mini-swe-agent's global config lives beside the result file, costs are not tracked.

`--bare` (harness.bare=true) swaps the config's two prompt templates, which mini-swe-agent leaves to the user,
for compact ones (COMPACT_TEMPLATES: the task text and one paragraph of rules, a first request of ~80 tokens instead of ~850);
the reply format, its parser (action regex), the observation and format-error templates, the step loop and
the submit command stay the stock config's.

Only the standard library is imported at module level: gyre's warm start reads MINI_SWE_AGENT_VERSION and
OFFLINE_ENV from the trainer's environment, where mini-swe-agent is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

MINI_SWE_AGENT_VERSION = "2.4.6"  # what tools/setup_env.sh installs and the tests ran against
CONFIG_NAME = "mini_textbased.yaml"
MODEL_NAME = "openai/gyre-policy"  # litellm's OpenAI path; the proxy serves any model name as the policy
COMPACT_TEMPLATES = {  # harness.bare: the same reply format and submit command, stated in one paragraph
    "system_template": "Reply with a THOUGHT line, then exactly ONE ```mswea_bash_command block holding ONE command.",
    "instance_template": (
        "{{task}}\n\nEach command runs in a new shell in the working directory. When the task is done, run "
        "`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` on its own."
    ),
}
REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = ".gyre/mini-swe-agent"  # relative to the checkout (and to /opt/gyre in the sandbox)
OFFLINE_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else litellm fetches model_prices_and_context_window.json on import
    "LITELLM_TELEMETRY": "False",
    "MSWEA_SILENT_STARTUP": "1",
    "MSWEA_COST_TRACKING": "ignore_errors",  # the policy has no price; a cost error would end the run
    "NO_PROXY": "127.0.0.1,localhost",
}


def venv_python(root: Path | str = REPO_ROOT) -> str:
    return f"{root}/{VENV}/bin/python"


def agent_config(max_turns: int, bare: bool = False) -> dict[str, Any]:
    """The stock text-based config, with the step limit from the task and no cost limit (`bare`: the compact
    system and instance templates)."""
    import yaml
    from minisweagent.config import builtin_config_dir

    config = yaml.safe_load((builtin_config_dir / CONFIG_NAME).read_text())
    config["agent"] |= {"step_limit": max_turns, "cost_limit": 0.0}
    config["agent"].pop("mode", None)  # interactive agents only
    if bare:
        config["agent"] |= COMPACT_TEMPLATES
    return config


def run(args: argparse.Namespace) -> dict[str, Any]:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    config = agent_config(args.max_turns, args.bare)
    model_kwargs = {
        **config["model"].get("model_kwargs", {}),
        "api_base": args.base_url,
        "api_key": os.environ.get("GYRE_API_KEY") or "none",
        "extra_headers": {"X-Rollout-Id": args.rollout_id},
        "temperature": args.temperature,
        "max_tokens": args.max_tokens,
    }
    model_cfg = {k: v for k, v in config["model"].items() if k != "model_kwargs"}
    model = LitellmTextbasedModel(model_name=MODEL_NAME, model_kwargs=model_kwargs, **model_cfg)
    env = LocalEnvironment(cwd=args.workspace, **config.get("environment", {}))
    agent = DefaultAgent(model, env, **config["agent"])
    prompt = json.loads(Path(args.task_file).read_text())["prompt"]
    try:
        info = agent.run(prompt)
    except Exception as e:  # an API error that survived litellm's and mini-swe-agent's retries
        return {"turns": agent.n_calls, "stop_reason": "api_error", "errors": [f"{type(e).__name__}: {e}"]}
    return {"turns": agent.n_calls, "stop_reason": str(info.get("exit_status") or "completed"), "errors": []}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run mini-swe-agent on one task against the Gyre proxy")
    for name in ("--base-url", "--rollout-id", "--workspace", "--task-file", "--result-file"):
        p.add_argument(name, required=True)
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--bare", action="store_true", help="compact system and instance templates (COMPACT_TEMPLATES)")
    args = p.parse_args(argv)
    result_file = Path(args.result_file)
    config_dir = result_file.parent / "mswea"
    config_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(OFFLINE_ENV, MSWEA_GLOBAL_CONFIG_DIR=str(config_dir))
    try:
        summary = run(args)
    except Exception:
        summary = {"turns": 0, "stop_reason": "harness_error", "errors": [traceback.format_exc()[-2000:]]}
        result_file.write_text(json.dumps(summary))
        raise
    result_file.write_text(json.dumps(summary))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
