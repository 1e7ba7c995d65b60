"""One GPU environment: gyre's requirements and SGLang's (the release its requests are checked against) agree.

The unit tests read the requirement lists (pyproject.toml, SGLang's installed metadata) and check every pin one
side sets against the other side's specifier: the conflict that kept `pip install gyre` and SGLang's runtime
apart (torch==2.13.0 against torch==2.14.1) is of that kind. The gpu-tier test runs pip's resolver over
gyre[gpu] for real: the index reachable here serves no separate wheel metadata, so pip downloads every wheel
(torch and SGLang's kernels: ~1 GB, 2-3 min), too slow for CI.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from gyre.engine.sglang_backend import SGLANG_VERSION, runtime_skew

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def gyre_requirements(*extras: str) -> list[Requirement]:
    lines = PYPROJECT["dependencies"] + [r for e in extras for r in PYPROJECT["optional-dependencies"][e]]
    return [r for r in map(Requirement, lines) if r.marker is None or r.marker.evaluate()]


def sglang_requirements() -> list[Requirement]:
    """SGLang's own Requires-Dist (tools/setup_env.sh installs its wheel --no-deps: the metadata is here)."""
    assert importlib.metadata.version("sglang") == SGLANG_VERSION, "tools/setup_env.sh installs SGLang's source"
    reqs = map(Requirement, importlib.metadata.requires("sglang"))
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def pin(req: Requirement) -> str | None:
    specs = list(req.specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None


def conflicts(ours: list[Requirement], theirs: list[Requirement]) -> list[str]:
    """Each name both sides require where one side's pin falls outside the other's specifier."""
    by_name = {r.name.lower(): r for r in theirs}
    found = []
    for a in ours:
        b = by_name.get(a.name.lower())
        if b is None:
            continue
        if any((v := pin(x)) and not y.specifier.contains(v, prereleases=True) for x, y in ((a, b), (b, a))):
            found.append(f"{a} vs {b}")
    return found


@pytest.mark.unit
def test_the_gpu_extra_pins_the_sglang_release_the_payload_tests_read():
    assert [str(r) for r in gyre_requirements("gpu") if r.name == "sglang"] == [f"sglang=={SGLANG_VERSION}"]
    assert f"SGLANG_VERSION={SGLANG_VERSION}\n" in (ROOT / "tools/setup_env.sh").read_text()  # the source installed


@pytest.mark.unit
def test_gyre_and_sglang_requirements_have_no_conflicting_pin():
    assert conflicts(gyre_requirements("gpu", "dev"), sglang_requirements()) == []
    # and the check sees the conflict that was there: gyre's old exact CPU pin against SGLang's torch
    assert conflicts([Requirement("torch==2.13.0")], sglang_requirements()) == ["torch==2.13.0 vs torch==2.14.1"]


@pytest.mark.unit
def test_the_cpu_pin_of_setup_env_lies_in_the_package_range():
    cpu_pin = re.search(r'install "torch==([0-9.]+)"', (ROOT / "tools/setup_env.sh").read_text()).group(1)
    torch_req = next(r for r in gyre_requirements() if r.name == "torch")
    assert torch_req.specifier.contains(cpu_pin) and pin(torch_req) is None
    megatron = next(r for r in gyre_requirements() if r.name == "megatron-core")
    assert megatron.specifier.contains(importlib.metadata.version("megatron-core"))


@pytest.mark.unit
def test_version_skew_between_trainer_and_engine_interpreters_is_named():
    engine = {"sglang": SGLANG_VERSION, "torch": "2.14.1+cu130", "nccl": "2.28.9"}
    same = {"torch": "2.14.1+cu130", "nccl": "2.28.9"}
    assert runtime_skew(engine, same, "distributed") == [] and runtime_skew(engine, same, "tensor") == []
    older = {"torch": "2.13.0+cu128", "nccl": "2.27.5"}
    assert runtime_skew(engine, older, "disk") == []  # a checkpoint on disk crosses any skew
    [nccl] = runtime_skew(engine, older, "distributed")
    assert "NCCL 2.28.9 in the engine, 2.27.5 in the trainer" in nccl
    [torch_skew] = runtime_skew(engine, older, "tensor")
    assert "torch 2.14.1+cu130 in the engine, 2.13.0+cu128" in torch_skew
    assert runtime_skew(engine, {"torch": "2.13.0+cpu", "nccl": ""}, "distributed") == []  # a CPU trainer: gloo
    [release] = runtime_skew({**engine, "sglang": "0.5.9"}, same, "disk")
    assert "SGLang 0.5.9 where gyre speaks 0.5.23" in release


@pytest.mark.gpu
def test_pips_resolver_installs_gyre_gpu_with_sglangs_torch(tmp_path):
    """pip's resolver over gyre[gpu] (no install; --no-binary for hydra's antlr4, an sdist only)."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}  # PyPI as a fresh site sees it, not local wheel caches
    report = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
           str(report), "--only-binary", ":all:", "--no-binary", "antlr4-python3-runtime", "--no-build-isolation",
           f"{ROOT}[gpu]"]  # fmt: skip
    subprocess.run(cmd, check=True, env=env, timeout=900)
    chosen = {
        i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert chosen["sglang"] == SGLANG_VERSION and chosen["torch"] == "2.14.1" and "megatron-core" in chosen
