"""The Harbor verifier, run as the checker of a Harbor task in its grading sandbox. Standard library only.

spec = {"workspace", "workdir", "tests_dir", "logs_dir", "test_script", "env", "tests_timeout_s",
"pid_namespace", "reward_guard"}. As Harbor's verifier does: empty /logs/verifier, run
`bash /tests/<test_script>` from the working directory (its output to /logs/verifier/test-stdout.txt), then
read the reward by Harbor's rule: reward.txt (one number) first, else reward.json (named scores). Tests
that run past their time, die of a signal or leave a process behind score 0 as the agent's failure,
whatever the reward file says (gyre.tasks.agent_code). After a clean run, no reward file, an empty one or a
value that is not a finite number is an evaluation error (the grade fails, it is never a zero or a pass):
the task's tests did not do their part.

The reward is the script's to write, not the agent's code's: the reward guard (runner_hooks/reward_guard.c,
preloaded into the script's shell) puts every program the script starts under Landlock, where
verifier/reward.txt and reward.json are links into a directory nothing but the script's own shell can
write. The script waits (runner_hooks/reward_gate.sh) until the guard is armed; where it cannot be (no
Landlock here, the library did not load) grading is refused as an evaluation error, never run unguarded.
One program the shell starts writes the reward as its own hand: `python3 -c CODE` (the script's own code,
inline), admitted unrestricted in isolated mode when the interpreter and all it loads are the image's
(read-only); see reward_guard.c. Any other program that writes the reward (a script file, a program of the
workspace, anything the agent's code starts) is refused, so such a task scores 0 here: tools/check_tasks
reports it.

The score is reward.json's "reward" when it names one, else the mean of its scores (partial credit);
each named score is one result (passed when >= 1). Per-test results in /logs/verifier/ctrf.json (pytest
--ctrf) are recorded as results too; they do not change the score.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

from gyre.tasks import agent_code
from gyre.tasks.agent_code import evaluation_broken, run_tests

REWARD_FILES = ("reward.txt", "reward.json")  # Harbor's precedence: reward.txt, then reward.json
REWARD_DIR = ".reward"  # under the logs directory: where verifier/reward.* point, written by the script's shell only
RUNNER_HOOKS = Path(agent_code.__file__).with_name("runner_hooks")  # run as a script: no __file__ of our own
GATE = RUNNER_HOOKS / "reward_gate.sh"
ARM_WAIT_S = 5.0  # the shell says "armed" as it starts: this is for a machine under load
LANDLOCK_CREATE_RULESET, LANDLOCK_CREATE_RULESET_VERSION = 444, 1

NETWORK_ERRORS = ("could not resolve host", "temporary failure in name resolution", "network is unreachable",
                  "name or service not known", "failed to download", "failed to fetch", "error sending request",
                  "dns error", "connection refused", "failed to connect to")  # fmt: skip


_PYTEST_SUMMARY = re.compile(r"^=+ .*\b(passed|failed|errors?|skipped)\b.* in [\d.]+s", re.MULTILINE)


def network_hint(test_output: str) -> str:
    """'' unless the tests' output shows them reaching for the network (and pytest never reporting: the tests
    did not get to run), else a sentence that says so."""
    if _PYTEST_SUMMARY.search(test_output):
        return ""
    for line in test_output.splitlines():
        if any(sign in line.lower() for sign in NETWORK_ERRORS):
            return (f"the tests need the network, which grading does not have ({line.strip()[:160]!r}): bake what "
                    "they fetch into the image (a RUN step; uvx commands are prepared offline by gyre)")  # fmt: skip
    return ""


def read_rewards(directory: Path) -> dict[str, float]:
    """The verifier's rewards as Harbor reads them (reward.txt first, then reward.json); raises ValueError."""
    path = directory / "reward.txt"
    if path.is_file():
        text = path.read_text()
        if not text.strip():
            raise ValueError(f"{path} is empty")
        rewards = {"reward": float(text)}
    else:
        path = directory / "reward.json"
        if not path.is_file():
            raise ValueError(f"no reward file: the tests wrote neither reward.txt nor reward.json in {directory}")
        text = path.read_text()
        if not text.strip():
            raise ValueError(f"{path} is empty")
        data = json.loads(text)
        rewards = data if isinstance(data, dict) else {"reward": data}
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


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 or less where there is none."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return int(libc.syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), LANDLOCK_CREATE_RULESET_VERSION))


def prepare_logs(logs: Path) -> Path:
    """A fresh verifier/ whose reward files are links into the directory only the script's shell can write."""
    for sub in ("verifier", "agent", "artifacts", REWARD_DIR):
        (logs / sub).mkdir(parents=True, exist_ok=True)
    verifier = logs / "verifier"
    for name in REWARD_FILES:
        (verifier / name).unlink(missing_ok=True)
        (logs / REWARD_DIR / name).unlink(missing_ok=True)
        (verifier / name).symlink_to(logs / REWARD_DIR / name)
    return verifier


class RewardGuard:
    """The test script's shell, started with the guard preloaded, is let past its gate only once armed."""

    def __init__(self, library: str, logs: Path) -> None:
        if Path(logs).parent != Path("/"):
            evaluation_broken(f"the reward guard needs the logs directory at the root, not {logs}")
        abi = landlock_abi()
        if abi < 1:
            evaluation_broken("this kernel has no Landlock (Linux >= 5.13 with landlock among its LSMs): the reward "
                              "files cannot be kept from the agent's code, so Harbor grading is refused here")  # fmt: skip
        self.armed_r, self.armed_w = os.pipe()
        self.gate_r, self.gate_w = os.pipe()
        self.env = {"LD_PRELOAD": library, "GYRE_REWARD_GUARD_FD": str(self.armed_w),
                    "GYRE_REWARD_GUARD_LOGS": str(logs), "BASH_ENV": str(GATE), "GYRE_GATE_FD": str(self.gate_r)}  # fmt: skip
        self.pass_fds = (self.armed_w, self.gate_r)

    def started(self, proc: subprocess.Popen[bytes]) -> None:
        os.close(self.armed_w)
        os.close(self.gate_r)
        said = b""
        while not said.endswith(b"\n") and select.select([self.armed_r], [], [], ARM_WAIT_S)[0]:
            chunk = os.read(self.armed_r, 64)
            if not chunk:
                break
            said += chunk
        os.close(self.armed_r)
        if said != b"armed\n":
            os.close(self.gate_w)
            evaluation_broken(f"the reward guard did not arm in the test script's shell (it said {said!r}): "
                              "the library did not load there (another C library in the task's image?)")  # fmt: skip
        agent_code.agent_code_starts()  # the script's shell waits at the gate until now: nothing of the agent's ran
        os.write(self.gate_w, b"go\n")
        os.close(self.gate_w)


def exit_watch_env(spec: dict[str, Any], report_fd: int) -> dict[str, str]:
    """The tests' Python processes that load the agent's code report their own os._exit (runner_hooks)."""
    path = [str(RUNNER_HOOKS), *filter(None, [spec.get("env", {}).get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path), "GYRE_AGENT_CODE_DIRS": f"{spec['workdir']}:{spec['workspace']}",
            "GYRE_EXIT_REPORT_FD": str(report_fd)}  # fmt: skip


def reported_exits(report_r: int) -> list[str]:
    """What the tests' processes reported on the exit pipe (all writers have ended)."""
    os.set_blocking(report_r, False)
    data = b""
    try:
        while chunk := os.read(report_r, 1 << 16):
            data += chunk
    except BlockingIOError:
        pass
    os.close(report_r)
    return [line for line in data.decode(errors="replace").splitlines() if line.startswith("os._exit")]


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    logs = Path(spec["logs_dir"])
    verifier = prepare_logs(logs)
    guard = RewardGuard(spec["reward_guard"], logs)
    exits_r, exits_w = os.pipe()
    script = Path(spec["tests_dir"]) / spec["test_script"]
    env = {**os.environ, **spec.get("env", {}), **exit_watch_env(spec, exits_w), **guard.env}
    with open(verifier / "test-stdout.txt", "wb") as log:  # agent code runs in there: never our stdout
        run = run_tests(["bash", str(script)], cwd=spec["workdir"], env=env, timeout_s=spec["tests_timeout_s"],
                        out=log, pid_namespace=spec["pid_namespace"], pass_fds=(*guard.pass_fds, exits_w),
                        started=guard.started)  # fmt: skip
    os.close(exits_w)
    failure = run.agent_failure()
    exits = reported_exits(exits_r)
    if failure is None and exits:
        failure = f"tests_incomplete: the agent's code left its process through {exits[0]}, before its tests could end"
    if failure is not None:  # whatever the reward file says now, the agent's code may have written it
        print(json.dumps({"results": [{"name": "tests", "passed": False, "detail": failure}], "agent_failed": failure}))
        return
    output = (verifier / "test-stdout.txt").read_text(errors="replace")
    try:
        rewards = read_rewards(logs / REWARD_DIR)
    except ValueError as e:
        hint = network_hint(output)
        evaluation_broken(
            f"{hint + '; ' if hint else ''}{e} (test.sh exited {run.returncode}; its output ends: {output[-400:]!r})"
        )
    results = [{"name": name, "passed": value >= 1.0, "detail": f"{value:g}"} for name, value in rewards.items()]
    if score_of(rewards) < 1.0 and (hint := network_hint(output)):
        results.append({"name": "network", "passed": False, "detail": hint})
    print(json.dumps({"results": results + ctrf_results(verifier), "score": score_of(rewards)}))


if __name__ == "__main__":
    main(sys.argv[1:])
