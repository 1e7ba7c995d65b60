"""Cluster users are never root (issue 31): the red-team tests and a small end-to-end run, as an unprivileged
user this module creates (useradd, removed at the end), with every sandbox made through an unprivileged user
namespace; and a site that disables those is refused at start with the setting named and Apptainer offered.

As root, the kernel exempts the sandbox's processes from RLIMIT_NPROC and lets them read more of /proc; as a
user it does not, and a pids cgroup is out of reach, so these runs are the ones a cluster sees. The user gets an
interpreter it can run (this environment's, or a venv of the same Python version whose .pth adds this
environment's site-packages: a venv under /root is out of its reach), its own HOME (caches: the reward guard is
built again for it) and nothing of root's environment.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import site
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from gyre.sandbox import userns
from gyre.store.reader import read_shard

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
USER = "gyre-unpriv-test"
RED_TEAM_TESTS = ["tests/test_red_team.py", "tests/test_grading_attacks.py", "tests/test_sandbox_limits.py"]
# the attacks of tests/test_red_team.py that only a sandbox stops
SANDBOX_ATTACKS = ("read_env_secret", "write_sibling_workspace", "engine_direct", "network_out", "forge_stolen_key",
                   "write_calls", "write_weights", "write_checkpoint", "write_shards", "write_cache")  # fmt: skip
# tests/resume_job.py's tiny job: a warm start good enough for some rollouts to earn partial credit, 16 rollouts a
# step; a step whose rewards are all equal within each group has nothing to train (seen for both steps of a run)
# scheduler=colocate: one cell in the user's process (the elastic default would also need the user's own mpirun)
TINY_RUN = ["scheduler=colocate", "steps=2", "rl.groups_per_step=2", "rl.group_size=8", "tasks.families=[write_value]",
            "warm_start.steps=60", "warm_start.demos=64", "warm_start.batch_size=8", "tokenizer.corpus_tasks=60",
            "tokenizer.vocab_size=512", "harness.max_turns=3", "harness.max_tokens=32", "sandbox.backend=bwrap"]  # fmt: skip


@dataclass(frozen=True)
class User:
    """How to run a command as the test's user: argv prefix, its environment, its HOME and its interpreter."""

    prefix: list[str]
    home: Path
    python: Path
    uid: int

    def run(self, argv: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home), "PYTHONPATH": str(ROOT),
                "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}  # fmt: skip
        environ = [f"{k}={v}" for k, v in {**base, **env}.items()]
        return subprocess.run([*self.prefix, "env", "-i", *environ, *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip


def ensure_user() -> tuple[int, int]:
    """(uid, gid) of USER, made a system user without a home or a login shell when missing (a run that died
    before its cleanup left it: reused)."""
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run([shutil.which("useradd") or "/usr/sbin/useradd", "--system", "--user-group",
                        "--no-create-home", "--shell", "/usr/sbin/nologin", USER], check=True, capture_output=True)  # fmt: skip
        entry = pwd.getpwnam(USER)
    return entry.pw_uid, entry.pw_gid


def user_python(workdir: Path, prefix: list[str]) -> Path:
    """An interpreter the user can start that imports this environment's packages: a venv (no pip) in `workdir`
    made from the first interpreter of this Python version the user can run, with a .pth adding this
    environment's site-packages (their own .pth files, the editable install's among them, are processed).
    Each is tried as the user's own processes start it (through env: setpriv's own exec reached a binary under
    a /root of mode 0700 that no process of the user could start)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
                  shutil.which(f"python{version}") or "", f"/usr/bin/python{version}"]  # fmt: skip
    runnable = [
        c
        for c in candidates
        if c and subprocess.run([*prefix, "env", c, "-c", ""], capture_output=True).returncode == 0
    ]
    if not runnable:
        pytest.fail(f"no Python {version} that {USER} can run (tried {candidates}): install python{version}")
    venv = workdir / "venv"
    subprocess.run([runnable[0], "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    (purelib,) = (venv / "lib").glob("python*/site-packages")
    lines = [f"import site; site.addsitedir({p!r})" for p in site.getsitepackages()]
    (purelib / "gyre-host-env.pth").write_text("\n".join(lines) + "\n")
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def user() -> Iterator[User]:
    """USER (as root: made here and removed at the end; as a user already: that user), its HOME and Python."""
    closed = [str(d) for d in (ROOT, *ROOT.parents) if not d.stat().st_mode & 0o001]
    made = os.geteuid() == 0
    assert made or not closed, (
        f"the checkout must be reachable by another user to run as one: {closed} not searchable (o+x)"
    )
    workdir = Path(tempfile.mkdtemp(prefix="gyre-unpriv-"))
    workdir.chmod(0o755)
    home = workdir / "home"
    home.mkdir()
    if made:
        uid, gid = ensure_user()
        os.chown(home, uid, gid)
        prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--inh-caps=-all"]
    else:
        uid, prefix = os.geteuid(), []
    try:
        with reachable_by(USER, closed):  # a checkout in a folder of mode 0700 (mktemp -d, a home): for the test's user
            yield User(prefix, home, user_python(workdir, prefix), uid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if made:
            subprocess.run([shutil.which("userdel") or "/usr/sbin/userdel", USER], check=True, capture_output=True)


@contextmanager
def reachable_by(user: str, folders: list[str]) -> Iterator[None]:
    """Folders of the checkout's path that other users may not search, opened to `user` alone by an ACL entry
    while it runs (the checkout itself readable: pytest lists it; those above it searchable), then their ACLs
    restored as they were."""
    if not folders:
        yield
        return
    setfacl, getfacl = shutil.which("setfacl"), shutil.which("getfacl")
    assert setfacl and getfacl, f"{folders} are not searchable by other users and setfacl is missing (apt install acl)"
    saved = subprocess.run([getfacl, "--absolute-names", *folders], check=True, capture_output=True, text=True).stdout
    try:
        for folder in folders:
            rights = "rx" if folder == str(ROOT) else "x"
            subprocess.run([setfacl, "-m", f"u:{user}:{rights}", folder], check=True, capture_output=True)
        yield
    finally:
        subprocess.run([setfacl, "--restore=-"], input=saved, text=True, check=True, capture_output=True)


def test_the_user_is_unprivileged_and_runs_this_checkout(user):
    code = ("import os, gyre; print(os.geteuid(), os.getegid(), gyre.__file__); "
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')][0])")  # fmt: skip
    proc = user.run([str(user.python), "-c", code], timeout=60)
    assert proc.returncode == 0, proc.stderr
    ids, caps = proc.stdout.split("\n")[:2]
    assert ids.split()[0] == str(user.uid) != "0" and ids.split()[2] == str(ROOT / "gyre" / "__init__.py")
    assert int(caps, 16) == 0  # no capabilities at all


def test_red_team_attacks_fail_as_an_unprivileged_user(user):
    """The red-team, grading-attack and resource-limit tests, their bwrap cases, run by the user through pytest:
    every one passes (each attack refused or scored 0 as the agent's failure), with the user's own processes."""
    junit, base = user.home / "red_team.xml", user.home / "pytest"
    proc = user.run([str(user.python), "-m", "pytest", *RED_TEAM_TESTS, "-k", "not none", "-q", "-p",
                     "no:cacheprovider", f"--basetemp={base}", f"--junitxml={junit}"], timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    suite = ET.parse(junit).getroot().find("testsuite")
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0 and counts["tests"] >= 30, counts
    (report_file,) = base.glob(
        "test_attacks_fail_in_the_sandb[0-9]*/run/rollouts/step0000/s0-g0-r0/workspace/report.json"
    )
    assert report_file.stat().st_uid == user.uid  # written by the user's sandboxed agent
    report = json.loads(report_file.read_text())
    refused = [name for name in SANDBOX_ATTACKS if not report[name]["ok"]]
    print(f"as uid {user.uid}: {counts['tests']} red-team tests passed; sandbox attacks refused "
          f"{len(refused)}/{len(SANDBOX_ATTACKS)}")  # fmt: skip
    assert refused == list(SANDBOX_ATTACKS), {n: report[n] for n in SANDBOX_ATTACKS}


def test_an_end_to_end_run_as_an_unprivileged_user(user):
    """launch.run at a toy size as the user: rollouts in bwrap sandboxes, graded, and trained on, every file the
    user's; the warm-start cache in the user's own HOME."""
    out = user.home / "run"
    args = [*TINY_RUN, f"output_dir={out}", f"hydra.run.dir={user.home / 'hydra'}"]
    proc = user.run([str(user.python), "-m", "launch.run", *args], timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("event") == "step"]  # the controller also writes its switch and session rows
    assert [r["step"] for r in rows] == [0, 1] and all(r["n_rollouts"] == 16 for r in rows), rows
    shards = [read_shard(p) for p in sorted((out / "shards").glob("*.h5"))]
    # an optimizer update on each step with an advantage to train on, none on the others (their rewards were equal)
    signal = [any(r.meta.advantage for s in shards if int(s.attrs["step"]) == step for r in s.trainable())
              for step in (0, 1)]  # fmt: skip
    assert [r["train/trained"] == 1.0 for r in rows] == signal, (rows, signal)
    assert all(r["tree_tokens"] > 0 for r in rows), rows
    assert {json.loads(s.attrs["producer"])["sandbox"] for s in shards} == {"bwrap"}
    stored = [r for s in shards for r in s]
    assert len(stored) == 32 and not any(r.meta.excluded for r in stored), [r.meta for r in stored]
    assert (out / "checkpoint" / "trainer" / ".metadata").stat().st_uid == user.uid  # a training step saved
    assert any((user.home / ".cache" / "gyre").iterdir())  # the user's own cache, not root's
    figures = [(r["step"], r["reward_mean"], r["train/trained"]) for r in rows]
    print(f"as uid {user.uid}: (step, reward_mean, trained) {figures}, {len(stored)} rollouts graded")


def test_a_site_without_user_namespaces_is_refused_at_start(user):
    """In a user namespace whose user.max_user_namespaces is 0 (a nested namespace sets its own limit; the host is
    untouched), launch.run stops before anything starts, with one line naming the setting and Apptainer."""
    limit = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    args = [*TINY_RUN, f"output_dir={user.home / 'refused'}", f"hydra.run.dir={user.home / 'hydra-refused'}"]
    proc = user.run(["unshare", "--user", "--map-root-user", "sh", "-c", limit, "sh", str(user.python), "-m",
                     "launch.run", *args], timeout=300)  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gyre:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "user.max_user_namespaces=0" in lines[0] and "sandbox.backend=apptainer" in lines[0], lines
    assert not (user.home / "refused" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("setting", "value"), userns.SETTINGS)
def test_each_disabling_setting_is_named(setting, value, monkeypatch):
    """Whichever of the three settings a site uses, the refusal names it (a probe that fails, sysctls as read)."""
    monkeypatch.setattr(userns, "probe_failure", lambda: "unshare(CLONE_NEWUSER): Operation not permitted")
    monkeypatch.setattr(userns, "sysctl", lambda name: value if name == setting else None)
    userns.userns_refusal.cache_clear()
    try:
        refusal = userns.userns_refusal()
    finally:
        userns.userns_refusal.cache_clear()
    assert f"({setting}={value})" in refusal and "sandbox.backend=apptainer" in refusal
