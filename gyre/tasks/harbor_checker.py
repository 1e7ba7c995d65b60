"""The Harbor verifier, run as the checker of a Harbor task in its grading sandbox. Standard library only.

spec = {"workspace", "workdir", "tests_dir", "logs_dir", "test_script", "env", "tests_timeout_s",
"pid_namespace"}. As Harbor's verifier does: empty /logs/verifier, run `bash /tests/<test_script>` from
the working directory (its output to /logs/verifier/test-stdout.txt), then read
/logs/verifier/reward.json (named scores) or, failing that, reward.txt (one number). Tests that run past
their time, die of a signal or leave a process behind score 0 as the agent's failure, whatever the
reward file says (gyre.tasks.agent_code). After a clean run, no reward file, an empty one or a value
that is not a finite number is an evaluation error (this script exits non-zero: the grade fails, it is
never a zero or a pass): the task's tests did not do their part.

The score is reward.json's "reward" when it names one, else the mean of its scores (partial credit);
each named score is one result (passed when >= 1). Per-test results in /logs/verifier/ctrf.json (pytest
--ctrf) are recorded as results too; they do not change the score.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from gyre.tasks.agent_code import evaluation_broken, run_tests


def read_rewards(verifier: Path) -> dict[str, float]:
    """The verifier's rewards as Harbor reads them (reward.json first, then reward.txt); raises ValueError."""
    path = verifier / "reward.json"
    if path.is_file():
        text = path.read_text()
        if not text.strip():
            raise ValueError(f"{path} is empty")
        data = json.loads(text)
        rewards = data if isinstance(data, dict) else {"reward": data}
    else:
        path = verifier / "reward.txt"
        if not path.is_file():
            raise ValueError(f"no reward file: the tests wrote neither {verifier}/reward.json nor reward.txt")
        text = path.read_text()
        if not text.strip():
            raise ValueError(f"{path} is empty")
        rewards = {"reward": float(text)}
    if not rewards:
        raise ValueError(f"{path} names no reward")
    for name, value in rewards.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"reward {name!r} in {path} is {value!r}, not a finite number")
    return {str(k): float(v) for k, v in rewards.items()}


def score_of(rewards: dict[str, float]) -> float:
    return rewards["reward"] if "reward" in rewards else sum(rewards.values()) / len(rewards)


def ctrf_results(verifier: Path) -> list[dict[str, Any]]:
    """Per-test results of a CTRF report (pytest --ctrf), when the tests wrote one."""
    try:
        tests = json.loads((verifier / "ctrf.json").read_text())["results"]["tests"]
        return [{"name": f"test: {t['name']}", "passed": t["status"] == "passed", "detail": t["status"]} for t in tests]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    verifier = Path(spec["logs_dir"]) / "verifier"
    for sub in ("verifier", "agent", "artifacts"):
        (Path(spec["logs_dir"]) / sub).mkdir(parents=True, exist_ok=True)
    for stale in ("reward.json", "reward.txt"):
        (verifier / stale).unlink(missing_ok=True)
    script = Path(spec["tests_dir"]) / spec["test_script"]
    env = {**os.environ, **spec.get("env", {})}
    with open(verifier / "test-stdout.txt", "wb") as log:  # agent code runs in there: never our stdout
        run = run_tests(["bash", str(script)], cwd=spec["workdir"], env=env, timeout_s=spec["tests_timeout_s"],
                        out=log, pid_namespace=spec["pid_namespace"])  # fmt: skip
    failure = run.agent_failure()
    if failure is not None:  # whatever the reward file says now, the agent's code may have written it
        print(json.dumps({"results": [{"name": "tests", "passed": False, "detail": failure}], "agent_failed": failure}))
        return
    try:
        rewards = read_rewards(verifier)
    except ValueError as e:
        tail = (verifier / "test-stdout.txt").read_text(errors="replace")[-400:]
        evaluation_broken(f"{e} (test.sh exited {run.returncode}; its output ends: {tail!r})")
    results = [{"name": name, "passed": value >= 1.0, "detail": f"{value:g}"} for name, value in rewards.items()]
    print(json.dumps({"results": results + ctrf_results(verifier), "score": score_of(rewards)}))


if __name__ == "__main__":
    main(sys.argv[1:])
