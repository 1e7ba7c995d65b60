"""Environment images: buildah builds a task's Dockerfile (RUN steps included) from a locally made base, once per
definition; bwrap runs rollouts and grading with the image's rootfs as `/`.

The integration tests use the machine's image cache ($GYRE_CACHE, else ~/.cache/gyre): the first run on a fresh
machine makes the bases with mmdebstrap and builds the image (minutes); every later run finds them (seconds).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
import torch
from test_harness import ScriptedServer, tool_reply

from gyre.config.schema import HarnessConfig, ModelConfig, ProxyConfig, SandboxConfig, TaskConfig
from gyre.engine.launcher import start_engine
from gyre.harness.claude_code import claude_bin
from gyre.harness.runner import run_rollout
from gyre.model.chat_template import IM_END, TOOL_CALL_END, TOOL_CALL_START, render_text, tool_call_json
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog
from gyre.proxy.keys import RolloutKeys
from gyre.proxy.server import ProxyServer
from gyre.sandbox import ApptainerSandbox, SandboxJob, SandboxUnavailable, make_sandbox
from gyre.sandbox.backends import PYTHON_ROOT, BwrapSandbox, image_env, relocated_python_mounts
from gyre.sandbox.base import GYRE_ROOT, Mount, code_mounts
from gyre.sandbox.overlay import CHANGES_DIR, RootOverlay
from gyre.sandbox.rootfs import IMAGE_PREFIX, cache_root, ensure_mountpoint, image_root, passwd_ids
from gyre.tasks.grading import grade_workspace
from gyre.tasks.harbor import load_harbor_task
from gyre.tasks.harbor_checker import network_hint
from gyre.tasks.harbor_root import root_changes
from gyre.tasks.images import (
    BaseImageMissing,
    BuildSpec,
    ImageBuilder,
    ImageBuildError,
    apptainer_build_argv,
    archive_stem,
    base_images,
    build_error,
    build_host_trust,
    build_task_environment,
    qualified,
    workspace_from_rootfs,
)
from gyre.tasks.offline_tests import PIP_DIR, offline_env, pip_requirements, uv_version, uvx_commands
from gyre.tasks.oracle import FORGEABLE, PLANTED_CONFTEST, check_task, solve
from gyre.tasks.source import load_instances
from tools.make_base_images import make_base
from tools.record_claude_code import CONTEXT_TOKENS, english_corpus

IMAGE_TASKS = Path(__file__).parent / "data" / "image_tasks"
MARKER_TASK = Path(__file__).parent / "data" / "claude_code_image_task" / "image-marker"


@pytest.mark.unit
def test_definition_digest_covers_the_dockerfile_and_every_context_file(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM debian:bookworm\nRUN true\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.bin").write_bytes(b"\x00\xff")
    spec = BuildSpec(tmp_path / "Dockerfile", tmp_path)
    first = spec.digest()
    assert spec.digest() == first
    (tmp_path / "data" / "in.bin").write_bytes(b"\x00\xfe")
    second = spec.digest()
    assert second != first
    (tmp_path / "data" / "in.bin").chmod(0o755)
    assert spec.digest() != second


@pytest.mark.unit
def test_base_image_names():
    dockerfile = "FROM --platform=linux/amd64 python:3.11-slim AS build\nRUN true\nFROM build\nFROM scratch\n"
    assert base_images(dockerfile) == ["python:3.11-slim"]
    assert qualified("debian:bookworm") == "docker.io/library/debian:bookworm"
    assert qualified("ubuntu") == "docker.io/library/ubuntu:latest"
    assert qualified("ghcr.io/org/img:1") == "ghcr.io/org/img:1"
    assert archive_stem("python:3.11-slim") == "python_3.11-slim"


@pytest.mark.unit
def test_apptainer_and_oci_archive_command_lines(tmp_path):
    """Golden: apptainer is not installable here; these are the command lines a cluster node runs."""
    assert apptainer_build_argv(Path("/c/img.tar"), Path("/c/img.sif")) == [
        "apptainer", "build", "--force", "/c/img.sif", "oci-archive:/c/img.tar"]  # fmt: skip
    builder = ImageBuilder(cache=tmp_path)
    assert builder.oci_archive_argv("gyre-env:abc", Path("/c/img.tar")) == [
        "buildah", "--root", f"{tmp_path}/storage", "--runroot", f"{tmp_path}/run", "push", "--quiet",
        "gyre-env:abc", "oci-archive:/c/img.tar:gyre-env:abc"]  # fmt: skip


@pytest.mark.unit
def test_dockerfile_user_resolves_in_the_image_passwd(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\nagent:x:1001:1002::/home/agent:/bin/sh\n")
    (tmp_path / "etc" / "group").write_text("root:x:0:\nstaff:x:50:\n")
    assert passwd_ids(tmp_path, "") == (0, 0)
    assert passwd_ids(tmp_path, "agent") == (1001, 1002)
    assert passwd_ids(tmp_path, "agent:staff") == (1001, 50)
    assert passwd_ids(tmp_path, "4242") == (4242, 4242)
    with pytest.raises(KeyError, match="nobody-here"):
        passwd_ids(tmp_path, "nobody-here")


@pytest.mark.unit
def test_bwrap_uses_the_image_rootfs_env_and_user(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path))
    image_dir = tmp_path / "images" / "d1"
    (image_dir / "rootfs" / "etc").mkdir(parents=True)
    meta = {"env": {"PATH": "/venv/bin:/usr/bin:/bin", "HOME": "/root", "MODE": "x"}, "workdir": "/app",
            "user": "agent", "uid": 1001, "gid": 1001}  # fmt: skip
    (image_dir / "image.json").write_text(json.dumps(meta))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    job = SandboxJob(argv=["true"], cwd="/app", mounts=[Mount(workspace, "/app", writable=True)],
                     image=IMAGE_PREFIX + "d1")  # fmt: skip
    argv = BwrapSandbox(SandboxConfig()).command(job)
    assert argv[argv.index("--ro-bind") : argv.index("--ro-bind") + 3] == ["--ro-bind", str(image_dir / "rootfs"), "/"]
    assert argv[argv.index("--uid") + 1] == "1001"
    env = {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--setenv"}
    assert env["PATH"] == "/venv/bin:/usr/bin:/bin" and env["MODE"] == "x" and env["HOME"] == "/home/agent"
    assert (image_dir / "rootfs" / "app").is_dir()  # the mount point, made on the host side
    assert "/usr" not in [argv[i + 2] for i, a in enumerate(argv) if a == "--ro-bind"]  # the image owns /usr
    with pytest.raises(Exception, match="not unpacked"):
        BwrapSandbox(SandboxConfig()).command(SandboxJob(argv=["true"], cwd="/", image=IMAGE_PREFIX + "gone"))


@pytest.mark.unit
def test_an_overlaid_root_keeps_the_images_system_trees_and_path_read_only(tmp_path, monkeypatch):
    """With a root overlay the command mounts it in a user and mount namespace of its own (unshare), binds it as
    `/`, the system trees, /etc and each PATH prefix read-only over it, and watches the agent's changes."""
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path))
    image_dir = tmp_path / "images" / "d3"
    for tree in ("usr/bin", "etc", "opt/venv/bin", "srv"):
        (image_dir / "rootfs" / tree).mkdir(parents=True)
    (image_dir / "rootfs" / "bin").symlink_to("usr/bin")
    meta = {"env": {"PATH": "/opt/venv/bin:/usr/bin:/bin"}, "workdir": "/", "user": "", "uid": 0, "gid": 0}
    (image_dir / "image.json").write_text(json.dumps(meta))
    overlay = RootOverlay.under(tmp_path / "ws.root", watch_upper=True)
    argv = BwrapSandbox(SandboxConfig()).command(SandboxJob(argv=["true"], cwd="/", image=IMAGE_PREFIX + "d3",
                                                            overlay=overlay))  # fmt: skip
    assert argv[argv.index("--user") - 1].endswith("unshare") and "--mount" in argv
    assert argv[argv.index("--bind") : argv.index("--bind") + 3] == ["--bind", str(overlay.merged), "/"]
    binds = {argv[i + 2]: argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"}
    assert {t: binds[t] for t in ("/usr", "/etc", "/opt/venv")} == {t: f"{overlay.merged}{t}" for t in
                                                                   ("/usr", "/etc", "/opt/venv")}  # fmt: skip
    assert "/srv" not in binds and "/bin" not in binds  # writable; /bin is the image's link into /usr
    assert binds[CHANGES_DIR] == str(overlay.upper) and f"{CHANGES_DIR}:{2048 << 20}" in argv


@pytest.mark.unit
def test_a_root_image_knows_the_sandbox_uid_it_runs_as(tmp_path, monkeypatch):
    """A root image runs as uid 1000, which its /etc/passwd lacks: a copy with an `agent` entry is bound over it
    (ssh-keygen and whoami look the user up); an image that has the uid keeps its own files."""
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path))
    image_dir = tmp_path / "images" / "d2"
    (image_dir / "rootfs" / "etc").mkdir(parents=True)
    (image_dir / "rootfs" / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (image_dir / "rootfs" / "etc" / "group").write_text("root:x:0:\n")
    meta = {"env": {"PATH": "/usr/bin:/bin"}, "workdir": "/", "user": "", "uid": 0, "gid": 0}
    (image_dir / "image.json").write_text(json.dumps(meta))
    argv = BwrapSandbox(SandboxConfig()).command(SandboxJob(argv=["true"], cwd="/", image=IMAGE_PREFIX + "d2"))
    binds = {argv[i + 2]: argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"}
    passwd = Path(binds["/etc/passwd"]).read_text().splitlines()
    assert passwd == ["root:x:0:0:root:/root:/bin/bash", "agent:x:1000:1000:agent:/home/agent:/bin/sh"]
    assert Path(binds["/etc/group"]).read_text().splitlines()[-1] == "agent:x:1000:"
    assert (image_dir / "rootfs" / "etc" / "passwd").read_text().count("\n") == 1  # the image is not changed
    (image_dir / "rootfs" / "etc" / "passwd").write_text("u:x:1000:1000::/home/u:/bin/sh\n")
    argv = BwrapSandbox(SandboxConfig()).command(SandboxJob(argv=["true"], cwd="/", image=IMAGE_PREFIX + "d2"))
    assert "/etc/passwd" not in argv


@pytest.mark.unit
def test_a_host_python_in_usr_moves_out_of_the_images_usr(monkeypatch):
    monkeypatch.setattr("sys.base_prefix", "/usr")
    mounts, relocate = relocated_python_mounts([Mount(Path("/usr"), "/usr"), Mount(Path("/w"), "/app", True)])
    assert mounts[0].target == PYTHON_ROOT and mounts[1].target == "/app"
    assert relocate("/usr/bin/python3.11") == f"{PYTHON_ROOT}/bin/python3.11" and relocate("/usrx") == "/usrx"
    assert image_env({"PYTHONPATH": "/lib"}, {"PYTHONPATH": "/opt/gyre", "HOME": "/h"}, {})["PYTHONPATH"] == (
        "/opt/gyre:/lib"
    )


@pytest.mark.integration
def test_a_missing_base_is_named_with_how_to_provide_it(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM gyre-test/no-such-base:1\nRUN true\n")
    with pytest.raises(BaseImageMissing) as e:
        ImageBuilder(stores=[tmp_path / "store"]).build(BuildSpec(tmp_path / "Dockerfile", tmp_path))
    message = str(e.value)
    assert "'gyre-test/no-such-base:1'" in message and "gyre-test_no-such-base_1.tar" in message
    assert "python -m tools.make_base_images" in message and str(tmp_path / "store") in message


@pytest.fixture(scope="module")
def bases() -> dict[str, float]:
    """The locally made bases (made once per machine: mmdebstrap from the Debian archive), with the seconds taken."""
    builder, store, took = ImageBuilder(), cache_root() / "bases", {}
    for name in ("debian:bookworm", "python:3.11-slim"):
        started = time.monotonic()
        assert make_base(builder, name, store).is_file()
        took[name] = time.monotonic() - started
    return took


@pytest.mark.integration
def test_a_harbor_task_builds_and_runs_end_to_end_in_its_image(bases, capsys):
    """The Dockerfile's RUN makes the input, COPY puts a script outside /app, ENV and USER are set: the oracle
    scores 1 and the do-nothing agent 0, graded inside the image under bwrap; the second build is a cache hit."""
    task = load_harbor_task(IMAGE_TASKS / "csv-sum", build_images=True)
    builder = ImageBuilder()
    started = time.monotonic()
    built = build_task_environment(task, builder)
    first_s = time.monotonic() - started
    started = time.monotonic()
    assert build_task_environment(task, builder) == built
    cached_s = time.monotonic() - started
    assert built.image.startswith(IMAGE_PREFIX) and built.workdir == "/app"
    assert sorted(built.files) == ["README.txt", "data/numbers.csv"]  # data/ exists only through RUN
    assert len(built.files["data/numbers.csv"].split()) == 200
    report = check_task(built, make_sandbox(SandboxConfig()), check_timeout_s=60)
    assert (report.oracle.score, report.nop.score, report.problem) == (1.0, 0.0, ""), report.line()
    assert cached_s < 1.0
    with tarfile.open(builder.oci_archive(built.image)) as archive:  # what `apptainer build x.sif oci-archive:` reads
        assert {"index.json", "oci-layout"} <= set(archive.getnames())
    meta = json.loads((cache_root() / "images" / built.image[len(IMAGE_PREFIX) :] / "image.json").read_text())
    with capsys.disabled():
        print(f"\n[images] bases {', '.join(f'{k} {v:.1f}s' for k, v in bases.items())}; task image "
              f"{first_s:.1f}s (buildah {meta['built_s']}s + unpack {meta['unpacked_s']}s when built), cached {cached_s:.3f}s")  # fmt: skip


@pytest.mark.integration
def test_the_image_sandbox_has_no_network_and_a_read_only_root(bases, tmp_path):
    built = build_task_environment(load_harbor_task(IMAGE_TASKS / "csv-sum", build_images=True), ImageBuilder())
    sandbox = make_sandbox(SandboxConfig())
    probe = ("import socket, os\n"
             "try:\n    socket.create_connection(('deb.debian.org', 80), timeout=5); print('net')\n"
             "except OSError:\n    print('no-net')\n"
             "try:\n    open('/etc/x', 'w'); print('rw')\n"
             "except OSError:\n    print('ro')\n"
             "print(os.getcwd(), os.getuid(), os.environ['CSV_SUM_EXPECTED_LINES'])\n")  # fmt: skip
    (tmp_path / "ws").mkdir()
    job = SandboxJob(argv=["python3", "-c", probe], cwd="/app", image=built.image,
                     mounts=[*code_mounts(), Mount(tmp_path / "ws", "/app", writable=True)])  # fmt: skip
    out = subprocess.run(sandbox.command(job), capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["no-net", "ro", "/app", "1001", "200"], out.stderr


@pytest.mark.integration
def test_tasks_build_images_gives_the_run_its_built_tasks(bases):
    tasks = load_instances(TaskConfig(source="harbor", path=str(IMAGE_TASKS), split="all", build_images=True))
    task = {t.task_id: t for t in tasks}["csv-sum"]
    assert task.image.startswith(IMAGE_PREFIX) and "data/numbers.csv" in task.files
    assert image_root(task.image).uid == 1001


TB2_TEST = """#!/bin/bash
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.9.7/install.sh | sh
source $HOME/.local/bin/env
uvx \\
  --with pytest==8.4.1 \\
  --with pytest-json-ctrf==0.3.5 \\
  pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA
uvx -p 3.11 -w pytest==8.4.1 pytest /tests/x.py  # another
"""


@pytest.mark.unit
def test_the_uvx_commands_a_test_script_runs_are_what_gets_prepared():
    assert uvx_commands(TB2_TEST) == [
        ["--with", "pytest==8.4.1", "--with", "pytest-json-ctrf==0.3.5", "pytest", "--version"],
        ["-p", "3.11", "-w", "pytest==8.4.1", "pytest", "--version"],
    ]
    assert uv_version(TB2_TEST) == "0.9.7" and uvx_commands("python3 -m pytest /tests\n") == []


PIP_TEST = """#!/bin/bash
set -uo pipefail
pip install --quiet --no-cache-dir pytest==8.2.2 2>/dev/null || \\
pip install --quiet --no-cache-dir --break-system-packages pytest==8.2.2
python3 -m pip install -q -r /tests/requirements.txt numpy==1.26.4 -i https://example.org/simple && echo ok
pip3 install --target /tmp/x ./local-dir requests; pytest /tests/test_outputs.py > /logs/verifier/out.txt
"""


@pytest.mark.unit
def test_the_packages_a_test_scripts_pip_installs_name_are_what_gets_prepared():
    """Options and their values, requirement files and local paths are left out; each package once, in order."""
    assert pip_requirements(PIP_TEST) == ["pytest==8.2.2", "numpy==1.26.4", "requests"]
    assert pip_requirements("python3 -m pytest /tests\necho pip install x\n") == []
    env = offline_env("/usr/bin", pip=True)
    assert env["PATH"].split(":")[1] == f"{PIP_DIR}/site/bin" and env["PYTHONPATH"] == f"{PIP_DIR}/site"
    assert env["PIP_NO_INDEX"] == "1" and "PYTHONPATH" not in offline_env("/usr/bin")


@pytest.mark.unit
def test_network_failures_are_named_unless_the_tests_ran():
    hint = network_hint("curl: (6) Could not resolve host: astral.sh\nbash: uvx: command not found\n")
    assert "need the network" in hint and "astral.sh" in hint
    assert network_hint("curl: (6) Could not resolve host: astral.sh\n===== 1 failed, 2 passed in 0.31s =====\n") == ""
    assert network_hint("AssertionError: 3 != 4\n") == ""


@pytest.mark.integration
def test_a_terminal_bench_style_test_that_fetches_uv_and_pytest_runs_offline(bases):
    """tests/test.sh curls the uv installer and runs `uvx --with pytest==8.4.1 ...`: prepared at build time, it
    grades with no network: the oracle 1 (both pytest tests pass, per-test results from CTRF), the no-op 0."""
    built = build_task_environment(load_harbor_task(IMAGE_TASKS / "word-count-uvx", build_images=True), ImageBuilder())
    assert built.grading["env"]["UV_OFFLINE"] == "1" and Path(built.grading["offline_tests"], "bin", "uvx").is_file()
    report = check_task(built, make_sandbox(SandboxConfig()), check_timeout_s=120)
    assert (report.oracle.score, report.nop.score, report.problem) == (1.0, 0.0, ""), report.line()
    assert {c["name"]: c["passed"] for c in report.oracle.checks}["test: test_outputs.py::test_count_is_right"]


@pytest.mark.integration
def test_a_test_that_pip_installs_pytest_at_test_time_runs_offline(bases, tmp_path):
    """tests/test.sh `pip install pytest==8.2.2` (the image has no pytest), then `pytest`: prepared at build time
    by the image's pip, it grades with no network: the oracle 1, the no-op 0."""
    task_dir = tmp_path / "word-count-pip"
    shutil.copytree(IMAGE_TASKS / "word-count-uvx", task_dir)
    (task_dir / "tests" / "test.sh").write_text(
        "pip install --quiet --no-cache-dir pytest==8.2.2\n"
        "pytest /tests/test_outputs.py -rA && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    )
    built = build_task_environment(load_harbor_task(task_dir, build_images=True), ImageBuilder())
    assert built.grading["env"]["PIP_NO_INDEX"] == "1"
    assert Path(built.grading["offline_tests"], "pip", "site", "bin", "pytest").is_file()
    report = check_task(built, make_sandbox(SandboxConfig()), check_timeout_s=120)
    assert (report.oracle.score, report.nop.score, report.problem) == (1.0, 0.0, ""), report.line()


@pytest.mark.integration
def test_a_test_that_still_needs_the_network_fails_the_oracle_check_saying_so(bases, tmp_path):
    task_dir = tmp_path / "needs-net"
    shutil.copytree(IMAGE_TASKS / "word-count-uvx", task_dir)
    (task_dir / "tests" / "test.sh").write_text(
        "python3 -c \"import urllib.request; urllib.request.urlopen('https://example.org/', timeout=10)\" "
        "&& echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    )
    built = build_task_environment(load_harbor_task(task_dir, build_images=True), ImageBuilder())
    report = check_task(built, make_sandbox(SandboxConfig()), check_timeout_s=60)
    assert report.broken and "need the network" in report.problem, report.line()


@pytest.mark.integration
def test_a_rollout_runs_in_the_image_and_is_graded_there(bases, tmp_path):
    """The built-in harness runs in the task's image (its rootfs as /, /app the workspace made from the image's
    /app), reads the RUN-made input, writes the answer; grading in the same image scores it 1."""
    built = build_task_environment(load_harbor_task(IMAGE_TASKS / "csv-sum", build_images=True), ImageBuilder())
    answer = str(sum(int(x) for x in built.files["data/numbers.csv"].split()))
    script = [tool_reply("read_file", 0, path="data/numbers.csv"),
              tool_reply("write_file", 1, path="answer.txt", content=answer), tool_reply("finish", 2)]  # fmt: skip

    async def main():
        async with ScriptedServer({"r": script}) as url:
            return await run_rollout(built, "r", url, tmp_path / "r", HarnessConfig(timeout_s=60.0), TaskConfig())

    outcome = asyncio.run(main())
    assert (outcome.grade.status, outcome.grade.score) == ("ok", 1.0), outcome.grade
    assert outcome.turns == 3


@pytest.mark.unit
def test_apptainer_runs_a_built_image_from_its_sif_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_CACHE", str(tmp_path))
    (tmp_path / "images" / "d2").mkdir(parents=True)
    (tmp_path / "images" / "d2" / "image.sif").write_bytes(b"")
    sandbox = ApptainerSandbox(SandboxConfig(backend="apptainer", apptainer_image=str(tmp_path / "default.sif")))
    assert sandbox.image_for(IMAGE_PREFIX + "d2") == str(tmp_path / "images" / "d2" / "image.sif")
    with pytest.raises(SandboxUnavailable, match="apptainer build .*image.sif oci-archive:.*image.oci.tar"):
        sandbox.image_for(IMAGE_PREFIX + "not-converted")  # never the default .sif: the task's image is its own


@pytest.mark.unit
def test_a_failed_builds_cause_starts_with_the_builders_error():
    out = ["WARNING: Running pip as the 'root' user", "debconf: delaying package configuration",
           "Error: building at STEP \"COPY environment/data/ /task/\": checking on sources: no such file"]  # fmt: skip
    assert build_error(out).startswith("Error: building at STEP") and build_error([]) == "(no output)"
    assert build_error(["E: Unable to locate package nope", "exit status 100"]) == "E: Unable to locate package nope"


@pytest.mark.unit
def test_run_steps_trust_the_build_hosts_bundle_as_build_arguments_only(tmp_path, monkeypatch):
    """Behind a TLS-inspecting proxy a RUN step's pip needs the host's CA bundle: bound for the RUN steps and named
    by ARGs after each FROM (never ENV: the image stays what the Dockerfile makes); without one, nothing changes."""
    (tmp_path / "Dockerfile").write_text("FROM python:3.11-slim AS b\nRUN pip install x\nFROM b\nENV A=1\n")
    (tmp_path / "ca.pem").write_text("---\n")
    (tmp_path / "out").mkdir()
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "ca.pem"))
    dockerfile, args = build_host_trust(tmp_path / "Dockerfile", tmp_path / "out")
    lines = dockerfile.read_text().splitlines()
    assert lines[0] == "FROM python:3.11-slim AS b" and lines[1] == "ARG SSL_CERT_FILE" and "ARG PIP_CERT" in lines
    assert [ln for ln in lines if not ln.startswith("ARG ")] == ["FROM python:3.11-slim AS b", "RUN pip install x",
                                                                  "FROM b", "ENV A=1"]  # fmt: skip
    assert args[:2] == ["-v", f"{tmp_path / 'ca.pem'}:/opt/gyre/host-ca.crt:ro"]
    assert "--build-arg=PIP_CERT=/opt/gyre/host-ca.crt" in args
    monkeypatch.delenv("SSL_CERT_FILE")
    assert build_host_trust(tmp_path / "Dockerfile", tmp_path / "out") == (tmp_path / "Dockerfile", [])


@pytest.mark.unit
def test_binary_files_in_the_images_working_directory_are_kept_as_bytes(tmp_path):
    """A PNG the Dockerfile COPYs into WORKDIR (public tasks do) is workspace, kept as bytes, not a refused task."""
    png = b"\x89PNG\r\n\x1a\n\x00\xff"
    (tmp_path / "task" / "tools").mkdir(parents=True)
    (tmp_path / "task" / "puzzle.png").write_bytes(png)
    (tmp_path / "task" / "tools" / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "task" / "tools" / "run.sh").chmod(0o755)
    files, executables = workspace_from_rootfs(tmp_path, "/task")
    assert files == {"puzzle.png": png, "tools/run.sh": "#!/bin/sh\n"} and executables == ["tools/run.sh"]


@pytest.mark.unit
def test_mount_points_are_made_inside_the_rootfs_only(tmp_path):
    rootfs, outside = tmp_path / "rootfs", tmp_path / "outside"
    rootfs.mkdir()
    outside.mkdir()
    (rootfs / "opt").symlink_to(outside)  # an image's symlink, absolute on the host
    ensure_mountpoint(rootfs, "/run/gyre/proxy.sock", is_file=True)
    assert (rootfs / "run" / "gyre" / "proxy.sock").is_file()
    with pytest.raises(ValueError, match="symlink"):
        ensure_mountpoint(rootfs, "/opt/gyre/gyre")
    with pytest.raises(ValueError, match="leaves"):
        ensure_mountpoint(rootfs, "/app/../../x")
    assert list(outside.iterdir()) == []


@pytest.mark.integration
def test_uvx_asking_for_another_python_gets_the_machines_or_is_refused_by_name(bases, tmp_path):
    """`uvx -p 3.13` (Terminal-Bench 2's usual line) in a python 3.11 image: the machine's 3.13 (pyenv) is mounted
    and on PATH, prepared and graded offline; a machine without one refuses the task naming the version."""
    task_dir = tmp_path / "p313"
    shutil.copytree(IMAGE_TASKS / "word-count-uvx", task_dir)
    script = task_dir / "tests" / "test.sh"
    script.write_text(script.read_text().replace("uvx \\\n", "uvx -p 3.13 \\\n"))
    task = load_harbor_task(task_dir, build_images=True)
    if not (shutil.which("python3.13") or list((Path.home() / ".pyenv" / "versions").glob("3.13.*"))):
        with pytest.raises(ImageBuildError, match="Python 3.13"):
            build_task_environment(task, ImageBuilder())
        return
    built = build_task_environment(task, ImageBuilder())
    assert built.grading["offline_pythons"] and "3.13" in built.grading["offline_pythons"][0]
    report = check_task(built, make_sandbox(SandboxConfig()), check_timeout_s=120)
    assert (report.oracle.score, report.nop.score, report.problem) == (1.0, 0.0, ""), report.line()


@pytest.mark.integration
def test_the_claude_code_cli_runs_inside_a_task_image(bases, tmp_path):
    """Claude Code's native CLI (bound from .gyre/node, as for every rollout) starts in the image's rootfs, so its
    Bash tool runs the image's programs; its full rollouts are tested on the host's /usr in test_claude_code*."""
    claude_bin()  # fails with what to run when the CLI is not installed
    built = build_task_environment(load_harbor_task(IMAGE_TASKS / "csv-sum", build_images=True), ImageBuilder())
    cli = f"{GYRE_ROOT}/.gyre/node/node_modules/.bin/claude"
    job = SandboxJob(argv=[cli, "--version"], cwd="/tmp", mounts=code_mounts(), image=built.image)
    out = subprocess.run(make_sandbox(SandboxConfig()).command(job), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "(Claude Code)" in out.stdout, out.stderr


def one_reply_policy(root: Path, reply: str, instruction: str, steps: int = 300, sharpen: float = 4.0) -> Path:
    """A tiny Llama trained to answer any prompt (stdlib text as the system prompt, `instruction` or random words
    as the user turn) with `reply`; its final norm is scaled by `sharpen`, so that the engine's sampling at Claude
    Code's temperature 1 gives that reply every time. The engine, proxy and CLI are unchanged: this is the only
    scripted part, and it is in the weights."""
    torch.manual_seed(0)
    rng, texts = random.Random(0), english_corpus()
    tok = Tokenizer.train([*texts, *[reply] * 200], vocab_size=2048)  # the reply in few, unambiguous tokens
    tok.save(root / "tok")
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128, max_position_embeddings=CONTEXT_TOKENS)  # fmt: skip
    model, target = LlamaForCausalLM(cfg), tok.encode(reply)
    words = texts[0].split()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        text = rng.choice(texts)
        start, length = rng.randrange(len(text) - 5000), rng.choice([50, 300, 1000, 3000, 4500])
        user = instruction if rng.random() < 0.5 else " ".join(rng.choice(words) for _ in range(rng.randint(3, 60)))
        prompt = tok.encode(render_text([{"role": "system", "content": text[start : start + length]},
                                         {"role": "user", "content": user}]))  # fmt: skip
        seq = torch.tensor([prompt + target])
        logits = model(seq[:, :-1], torch.arange(seq.shape[1] - 1)[None])[0][0, len(prompt) - 1 :]
        loss = torch.nn.functional.cross_entropy(logits, seq[0, len(prompt) :])
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    state = model.state_dict()
    state["model.norm.weight"] = state["model.norm.weight"] * sharpen
    return save_hf_checkpoint(root / "ckpt", state, cfg, root / "tok")


@pytest.mark.integration
def test_claude_codes_bash_tool_runs_inside_the_task_image(bases, tmp_path, capsys):
    """A real Claude Code rollout (the pinned CLI, harness kind claude_code, bwrap, the proxy and the embedded
    engine) on a task built with an image: the policy's Bash call copies /opt/marker.txt, which only the
    Dockerfile's RUN made (not on the host, not in the workspace), into the workspace and prints it; Claude Code
    returns that output to the policy, and grading in the image scores the workspace 1."""
    claude_bin()  # fails with what to run when the CLI is not installed
    torch.set_num_threads(1)
    assert not Path("/opt/marker.txt").exists()  # the command can succeed only inside the image
    started = time.monotonic()
    built = build_task_environment(load_harbor_task(MARKER_TASK, build_images=True), ImageBuilder())
    build_s, started = time.monotonic() - started, time.monotonic()
    assert "opt/marker.txt" not in " ".join(built.files) and built.workdir == "/app"
    call = {"name": "Bash", "arguments": {"command": "cp /opt/marker.txt answer.txt && cat answer.txt"}}
    reply = TOOL_CALL_START + tool_call_json(call["name"], call["arguments"]) + TOOL_CALL_END + IM_END
    policy = one_reply_policy(tmp_path / "policy", reply, built.prompt)
    train_s, started = time.monotonic() - started, time.monotonic()
    engine = start_engine(policy, max_context_tokens=CONTEXT_TOKENS, log_path=tmp_path / "engine.log")
    keys = RolloutKeys()
    proxy = ProxyServer(Tokenizer.load(tmp_path / "policy" / "tok"), [engine.url],
                        ProxyConfig(max_context_tokens=CONTEXT_TOKENS, max_output_tokens=64),
                        CallLog(tmp_path / "calls.jsonl"), keys=keys)  # fmt: skip
    harness = HarnessConfig(kind="claude_code", bare=True, max_turns=2, timeout_s=300.0)
    try:
        proxy.start()
        outcome = asyncio.run(run_rollout(built, "cc-image", proxy.url, tmp_path / "rollout", harness, TaskConfig(),
                                          sandbox=make_sandbox(SandboxConfig(backend="bwrap")), keys=keys))  # fmt: skip
    finally:
        proxy.stop()
        engine.stop()
    rollout_s = time.monotonic() - started
    records = proxy.call_log.for_rollout("cc-image")
    assert records and records[0].tool_calls == [call], (records, outcome.stderr_tail)
    # Claude Code sent the command's output back: the next prompt holds the image's file
    assert len(records) > 1 and "image-only 42" in proxy.tokenizer.decode(records[1].input_ids), outcome.stderr_tail
    assert (tmp_path / "rollout" / "workspace" / "answer.txt").read_text() == "image-only 42\n", outcome.stderr_tail
    assert (outcome.grade.status, outcome.grade.score) == ("ok", 1.0), (outcome.grade, outcome.stderr_tail)
    with capsys.disabled():
        print(
            f"\n[images] claude code in the image: build {build_s:.1f}s, policy {train_s:.1f}s, rollout "
            f"{rollout_s:.1f}s ({len(records)} calls, stop {outcome.stop_reason}, turns {outcome.turns}, least token "
            f"logprob of the tool call {min(records[0].output_logprobs):.2g})"
        )


# ---------------------------------------------------------------- the image's root, writable (Harbor's container)

OUTSIDE_TEST = """\
[ "$(cat /output/answer.txt 2>/dev/null)" = 42 ] && r=1 || r=0
echo $r > /logs/verifier/reward.txt
"""
OUTSIDE_SOLVE = """\
mkdir -p /output && echo 42 > /output/answer.txt
for f in /etc/gyre-probe /usr/local/bin/gyre-probe; do (echo x > $f) 2>/dev/null && echo "$f: rw" || echo "$f: ro"; done
"""
# A losing agent that rearranges the root for its grading: a /logs and a /tests of its own, a /bin whose bash
# writes the reward, the loader's preload list, a program on PATH (each attempt may fail; none may count).
OUTSIDE_ATTACK = """\
mkdir -p /output && echo 41 > /output/answer.txt
rm -rf /logs /tests; mkdir -p /srv/logs/verifier && ln -s /srv/logs /logs
mkdir -p /tests && echo 'echo 1 > /logs/verifier/reward.txt' > /tests/test.sh
rm -f /bin; mkdir -p /bin && printf '#!/usr/bin/sh\\necho 1 > /logs/verifier/reward.txt\\n' > /bin/bash && chmod +x /bin/bash
echo /srv/evil.so > /etc/ld.so.preload
printf '#!/bin/sh\\necho 42\\n' > /usr/local/bin/cat && chmod +x /usr/local/bin/cat
true
"""


def outside_task(root: Path, solve_sh: str) -> Path:
    d = root / "outside"
    files = {"task.toml": "[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n", "instruction.md": "Write 42.",
             "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\nRUN mkdir -p /output\n",
             "tests/test.sh": OUTSIDE_TEST, "solution/solve.sh": solve_sh}  # fmt: skip
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


@pytest.mark.integration
def test_what_the_agent_writes_outside_its_working_directory_reaches_grading(bases, tmp_path):
    """Harbor grades in the agent's container: a solution that writes /output/answer.txt (outside /app) scores 1,
    the do-nothing agent 0; /usr and /etc stay the image's (read-only) for the agent too."""
    built = build_task_environment(load_harbor_task(outside_task(tmp_path, OUTSIDE_SOLVE), build_images=True),
                                   ImageBuilder())  # fmt: skip
    sandbox = make_sandbox(SandboxConfig())
    report = check_task(built, sandbox, check_timeout_s=60)
    assert (report.oracle.score, report.nop.score, report.problem) == (1.0, 0.0, ""), report.line()
    ws = built.materialize(tmp_path / "ws")
    problem, out = solve(built, ws, sandbox)
    assert problem == "" and out.split() == ["/etc/gyre-probe:", "ro", "/usr/local/bin/gyre-probe:", "ro"], out
    assert (root_changes(ws) / "upper" / "output" / "answer.txt").read_text() == "42\n"
    work = [Path(d) for d, _, _ in os.walk(root_changes(ws) / "work")]  # overlayfs made it 000: a user could not
    assert len(work) > 1 and all(d.stat().st_mode & 0o700 == 0o700 for d in work)  # remove the rollout's scratch


@pytest.mark.integration
def test_an_agent_rearranging_the_root_cannot_forge_its_grade(bases, tmp_path):
    built = build_task_environment(load_harbor_task(outside_task(tmp_path, OUTSIDE_ATTACK), build_images=True),
                                   ImageBuilder())  # fmt: skip
    sandbox = make_sandbox(SandboxConfig())
    ws = built.materialize(tmp_path / "ws")
    problem, out = solve(built, ws, sandbox)
    upper = root_changes(ws) / "upper"
    assert problem == "" and (upper / "logs").is_symlink() and (upper / "bin" / "bash").is_file(), out  # it took place
    grade = grade_workspace(built, ws, sandbox=sandbox)
    assert (grade.status, grade.score) == ("ok", 0.0), grade


# What pytest reads of its own accord above /tests/test_outputs.py, put there by a do-nothing agent: at `/`, its
# configuration (every test collected, none run: exit 0) or, with a setup.py making `/` the rootdir, a conftest.py
# that passes every test. Each scored 1.0 before the agent's runner configuration was dropped (measured).
ROOT_RUNNER_CONFIG = {
    "pytest_ini": "printf '[pytest]\\naddopts = --collect-only -q\\n' > /pytest.ini\n",
    "pyproject": "printf '[tool.pytest.ini_options]\\naddopts = \"--collect-only -q\"\\n' > /pyproject.toml\n",
    "conftest": f"touch /setup.py\ncat > /conftest.py <<'EOF'\n{PLANTED_CONFTEST}EOF\n",
}


@pytest.mark.integration
@pytest.mark.parametrize("attack", sorted(ROOT_RUNNER_CONFIG))
def test_runner_configuration_the_agent_puts_above_the_tests_never_reaches_grading(attack, bases, tmp_path):
    task_dir = tmp_path / "task"
    shutil.copytree(IMAGE_TASKS / "word-count-uvx", task_dir)
    (task_dir / "solution" / "solve.sh").write_text(ROOT_RUNNER_CONFIG[attack])
    built = build_task_environment(load_harbor_task(task_dir, build_images=True), ImageBuilder())
    sandbox = make_sandbox(SandboxConfig())
    ws = built.materialize(tmp_path / "ws")
    problem, out = solve(built, ws, sandbox)
    assert problem == "" and len(list((root_changes(ws) / "upper").glob("*"))) >= 1, out  # it took place
    grade = grade_workspace(built, ws, sandbox=sandbox, check_timeout_s=120)
    assert (grade.status, grade.score) == ("ok", 0.0), grade


# `python3 -m pytest` from the working directory puts it first on the import path and among the places installed
# distributions are found: a do-nothing agent's pytest there, or a dist-info whose pytest11 entry point pytest
# loads as a plugin that passes every test. Each scored 1.0 before runner_hooks/runner_imports.py (measured).
MODULE_RUN_TESTS = (
    "pip install --quiet --no-cache-dir pytest==8.2.2\n"
    "python3 -m pytest /tests/test_outputs.py -rA && echo 1 > /logs/verifier/reward.txt || "
    "echo 0 > /logs/verifier/reward.txt\n"
)
WORKDIR_RUNNER_ATTACKS = {
    "pytest_shadow": {"pytest.py": "raise SystemExit(0)\n"},
    "plugin_entry_point": {
        "evil-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n",
        "evil-1.0.dist-info/entry_points.txt": "[pytest11]\nevil = evilplug\n",
        "evilplug.py": PLANTED_CONFTEST,
    },
    "honest": {},
}


@pytest.mark.integration
@pytest.mark.parametrize("attack", sorted(WORKDIR_RUNNER_ATTACKS))
def test_tests_run_as_a_module_load_no_runner_or_plugin_of_the_agents(attack, bases, tmp_path):
    task_dir = tmp_path / "task"
    shutil.copytree(IMAGE_TASKS / "word-count-uvx", task_dir)
    (task_dir / "tests" / "test.sh").write_text(MODULE_RUN_TESTS)
    built = build_task_environment(load_harbor_task(task_dir, build_images=True), ImageBuilder())
    sandbox = make_sandbox(SandboxConfig())
    ws = built.materialize(tmp_path / "ws")
    if attack == "honest":  # the control: the task's solution, graded by the same script
        assert solve(built, ws, sandbox)[0] == ""
    for rel, text in WORKDIR_RUNNER_ATTACKS[attack].items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    grade = grade_workspace(built, ws, sandbox=sandbox, check_timeout_s=120)
    assert (grade.status, grade.score) == ("ok", 1.0 if attack == "honest" else 0.0), grade


@pytest.mark.integration
def test_the_images_empty_directories_are_in_the_workspace(bases, tmp_path):
    """`RUN mkdir -p out/deep` in the image's WORKDIR: a solution that writes out/deep/answer.txt without making
    it scores 1, as in the task's container (the workspace held only the image's files before: solve.sh failed)."""
    d = tmp_path / "empty-dirs"
    files = {"task.toml": "[verifier]\ntimeout_sec = 60.0\n[agent]\ntimeout_sec = 60.0\n", "instruction.md": "Write 42.",
             "environment/Dockerfile": "FROM debian:bookworm\nWORKDIR /app\nRUN mkdir -p out/deep empty data && "
                                       "echo 1 > data/x\n",
             "tests/test.sh": '[ "$(cat /app/out/deep/answer.txt)" = 42 ] && r=1 || r=0\necho $r > /logs/verifier/reward.txt\n',
             "solution/solve.sh": "set -e\necho 42 > out/deep/answer.txt\n"}  # fmt: skip
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    built = build_task_environment(load_harbor_task(d, build_images=True), ImageBuilder())
    assert built.directories == ["empty", "out/deep"] and set(built.files) == {"data/x"}
    assert (built.materialize(tmp_path / "ws") / "out" / "deep").is_dir()
    report = check_task(built, make_sandbox(SandboxConfig()), check_timeout_s=60)
    assert (report.oracle.score, report.nop.score, report.problem) == (1.0, 0.0, ""), report.line()


@pytest.mark.integration
def test_a_task_whose_tests_run_in_the_agents_directory_is_named_forgeable(bases, tmp_path):
    """tests/test.sh copies its tests into /app and runs pytest there (a pattern of tasks written by hand): a
    conftest.py the agent leaves in /app decides every outcome. The oracle 1, the do-nothing agent 0, and a
    planted conftest.py 1: check_task names the task forgeable (broken), where the same tests run from /tests
    are sound (test_a_terminal_bench_style_test_that_fetches_uv_and_pytest_runs_offline)."""
    task_dir = tmp_path / "word-count-in-app"
    shutil.copytree(IMAGE_TASKS / "word-count-uvx", task_dir)
    script = (task_dir / "tests" / "test.sh").read_text().replace(" /tests/test_outputs.py", " /app/test_outputs.py")
    script = script.replace("uvx \\\n", "cp /tests/test_outputs.py /app/test_outputs.py\nuvx \\\n")
    (task_dir / "tests" / "test.sh").write_text(script)
    built = build_task_environment(load_harbor_task(task_dir, build_images=True), ImageBuilder())
    report = check_task(built, make_sandbox(SandboxConfig()), check_timeout_s=120)
    assert (report.oracle.score, report.nop.score, report.verdict) == (1.0, 0.0, "broken"), report.line()
    assert report.causes == [FORGEABLE], report.line()
