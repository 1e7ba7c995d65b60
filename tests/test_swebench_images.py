"""SWE-bench instances in the environments their install specs define (gyre/tasks/swebench_images.py): the spec
becomes a Dockerfile buildah builds from a locally made python:3.11-slim, and grading runs in that image.

The integration test uses the machine's image cache ($GYRE_CACHE, else ~/.cache/gyre): the first run on a fresh
machine makes the bases and builds flask 2.3's environment (pip from PyPI: minutes); later runs find it.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from gyre.config.schema import SandboxConfig
from gyre.sandbox import SandboxJob, make_sandbox
from gyre.sandbox.base import code_mounts
from gyre.sandbox.rootfs import IMAGE_PREFIX, cache_root
from gyre.tasks.images import ImageBuilder, build_task_environment
from gyre.tasks.oracle import check_task
from gyre.tasks.swebench import load_swebench_suite
from gyre.tasks.swebench_images import (
    InstallSpec,
    Specs,
    environment_dockerfile,
    load_specs,
    requirements_text,
    snapshot_reader,
    spec_test_command,
)
from gyre.tasks.task import TaskFormatError
from tools.make_base_images import make_base

REAL = Path(__file__).resolve().parent.parent / "examples" / "tasks" / "swebench_real"
FLASK_ENV_COMMIT = "182ce3dd15dfa3537391c3efaf9c3ff407d134d4"
TEST_PATCH = "diff --git a/tests/test_config.py b/tests/test_config.py\n+x\ndiff --git a/tests/static/c.toml b/tests/static/c.toml\n"


@pytest.mark.unit
def test_the_specs_are_swebench_s_for_our_versions():
    specs = load_specs(REAL / "specs.json")
    flask = specs.spec_for("pallets/flask", "2.3")
    assert (flask.python, flask.packages, flask.install, flask.test_cmd) == (
        "3.11", "requirements.txt", "python -m pip install -e .", "pytest -rA")  # fmt: skip
    assert "Werkzeug==2.3.7" in flask.pip_packages and specs.requirements_paths["pallets/flask"] == [
        "requirements/dev.txt"
    ]
    assert specs.spec_for("marshmallow-code/marshmallow", "3.0").install == "python -m pip install -e '.[dev]'"
    with pytest.raises(TaskFormatError, match=r"no install spec for pallets/flask version 9\.9 .*\['2\.3'\]"):
        specs.spec_for("pallets/flask", "9.9")
    with pytest.raises(TaskFormatError, match="has no `version`"):
        specs.spec_for("pallets/flask", "")


@pytest.mark.unit
def test_a_spec_becomes_swebench_s_steps_in_a_dockerfile():
    spec = InstallSpec(python="3.11", test_cmd="pytest -rA", install="python -m pip install -e .",
                       packages="requirements.txt", pip_packages=("Werkzeug==2.3.7", "pandas<2"),
                       pre_install=("sed -i s/a/b/ setup.cfg",), eval_commands=("export LANG=C.UTF-8",))  # fmt: skip
    dockerfile = environment_dockerfile(spec, Specs(Path("specs.json"), {}, apt_packages=("git",)), requirements=True)
    lines = dockerfile.splitlines()
    assert lines[0] == "FROM python:3.11-slim" and lines[-1] == "RUN python -m pip install -e ."
    steps = [line.split()[0] for line in lines]
    assert steps == ["FROM", "ARG", "RUN", "COPY", "RUN", "RUN", "COPY", "WORKDIR", "RUN", "RUN"]
    assert "RUN python -m pip install Werkzeug==2.3.7 'pandas<2'" in lines  # one shell word each
    assert lines.index("COPY repo/ /testbed/") < lines.index("RUN sed -i s/a/b/ setup.cfg")  # pre_install in the repo
    assert spec_test_command(spec, TEST_PATCH) == ["bash", "-c", "export LANG=C.UTF-8\npytest -rA tests/test_config.py"]
    with pytest.raises(TaskFormatError, match="environment.yml"):
        InstallSpec.from_dict({"python": "3.9", "test_cmd": "pytest", "packages": "environment.yml"}, "x")
    with pytest.raises(TaskFormatError, match=r"unknown keys \['pip_package'\]"):
        InstallSpec.from_dict({"python": "3.9", "test_cmd": "pytest", "pip_package": []}, "x")


@pytest.mark.unit
def test_requirements_are_read_as_swebench_reads_them_at_the_environment_commit():
    """flask's requirements/dev.txt at environment_setup_commit, its -r files first, `-e .` and comments out."""
    read = snapshot_reader(REAL / "repos" / "pallets__flask", FLASK_ENV_COMMIT, "other", {})
    text = requirements_text(read, "flask", ["requirements/dev.txt"])
    lines = [line for line in text.splitlines() if line.strip()]
    assert "pytest==7.3.0" in lines and "sphinx==4.5.0" in lines and "mypy==1.2.0" in lines and "tox==4.4.11" in lines
    assert lines.index("pytest==7.3.0") < lines.index("tox==4.4.11")  # included files before the file's own lines
    assert not any(line.lstrip().startswith(("#", "-r", "-e .")) for line in lines)
    with pytest.raises(TaskFormatError, match="none of the requirement files"):
        requirements_text(read, "flask", ["requirements/none.txt"])


@pytest.mark.unit
def test_an_instance_without_a_spec_is_skipped_with_its_cause(tmp_path):
    row = json.loads((REAL / "instances.jsonl").read_text().splitlines()[0])
    (tmp_path / "instances.jsonl").write_text(json.dumps({**row, "version": "0.1"}) + "\n")
    (tmp_path / "repos").symlink_to(REAL / "repos")
    (tmp_path / "specs.json").write_text((REAL / "specs.json").read_text())
    tasks, skipped = load_swebench_suite(tmp_path / "instances.jsonl", build_images=True)
    assert tasks == [] and [s.name for s in skipped] == ["pallets__flask-4992"]
    assert "no install spec for pallets/flask version 0.1" in skipped[0].cause


@pytest.mark.integration
def test_a_swebench_instance_is_graded_in_its_spec_image():
    """flask-4992 in flask 2.3's environment (SWE-bench's pins, pip at build time, `pip install -e .` in
    /testbed): the reference patch scores 1 and the untouched repository 0, graded offline in the image under
    bwrap; the image has the spec's Werkzeug, not the host's; a second build is a cache hit."""
    store = cache_root() / "bases"
    assert make_base(ImageBuilder(), "python:3.11-slim", store).is_file()  # mmdebstrap, once per machine
    tasks, skipped = load_swebench_suite(REAL / "instances.jsonl", build_images=True)
    assert skipped == []
    task = next(t for t in tasks if t.task_id == "pallets__flask-4992")
    builder = ImageBuilder()
    started = time.monotonic()
    built = build_task_environment(task, builder)
    first_s = time.monotonic() - started
    started = time.monotonic()
    assert build_task_environment(task, builder) == built
    assert time.monotonic() - started < 5.0, "the second build is not a cache hit"
    assert built.image.startswith(IMAGE_PREFIX) and built.workdir == "/testbed"
    assert built.grading["test_cmd"] == ["bash", "-c", "pytest -rA tests/test_config.py"]
    assert built.files["docs/_static/flask-logo.png"][:8] == b"\x89PNG\r\n\x1a\n"  # binary files kept
    sandbox = make_sandbox(SandboxConfig())
    probe = "import flask, importlib.metadata as m; print(m.version('werkzeug'), flask.__file__)"
    job = SandboxJob(argv=["python3", "-c", probe], cwd="/", image=built.image, mounts=code_mounts())
    out = subprocess.run(sandbox.command(job), capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2.3.7", "/testbed/src/flask/__init__.py"], out.stderr
    report = check_task(built, sandbox, check_timeout_s=120.0)
    assert (report.verdict, report.oracle.score, report.nop.score) == ("sound", 1.0, 0.0), report.line()
    assert report.oracle.passed == report.oracle.total == 19
    print(f"\n[swebench image] {built.image}: {first_s:.1f}s to build or find")
