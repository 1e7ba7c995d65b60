"""tools/gpu_check.py: every section exercised on CPU with a tiny Qwen3 (CI), and the real run on a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("environment", "generation", "trainer", "weight_sync", "distributed_sync", "role_switch",
            "tree_vs_expanded", "tree_path_agreement", "hicache", "cell_cycle")  # fmt: skip


def run_check(out: Path, *flags: str, timeout: int) -> dict:
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(out), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["ok"], json.dumps(report["errors"], indent=1)[-6000:]
    return report


def check_figures(figures: dict) -> None:
    assert all(s in figures for s in SECTIONS)
    gen = figures["generation"]
    assert gen["proxy_completion_tokens"] > 0 and gen["proxy_tokens_per_s"] > 0 and gen["direct_tokens_per_s"] > 0
    sw = figures["role_switch"]
    assert 0 < sw["rollout_to_train_s"] and 0 < sw["train_to_rollout_s"] and sw["weight_load_s"] > 0
    assert figures["weight_sync"]["engine_load_s"] > 0
    cycle = figures["cell_cycle"]
    assert cycle["steps"] == 1 and cycle["last_step"]["version"] >= 1  # rollout -> train -> rollout on new weights
    for k in ("k5", "unbounded"):
        tree = figures["tree_vs_expanded"][k]
        assert tree["expanded_tokens"] >= tree["tree_tokens"] > 0 and tree["tree_fwd_bwd_s"] > 0
    agree = figures["tree_path_agreement"]
    assert agree["paths"] >= 2 and agree["tokens_compared"] > 0
    assert agree["max_abs_logprob_diff"] < 1e-3  # fp32 trainer: tree-packed equals path by path


@pytest.mark.unit
def test_the_hicache_sections_servers_and_requests_are_what_sglang_parses():
    """The device-only hicache section, checked here against SGLang's parser and request class."""
    from sglang_io import parse_like_sglang, parse_server_argv

    from gyre.engine.sglang_backend import sglang_server_args
    from tools import gpu_check

    cfg = gpu_check.hicache_config(gpu_check.Plan.for_run(False, "sglang"), "127.0.0.1:41000")
    ns, unknown = parse_server_argv(sglang_server_args("/m", cfg, 30000))
    assert not unknown and ns.enable_hierarchical_cache and ns.hicache_storage_backend == "mooncake"
    assert ns.mem_fraction_static == gpu_check.HICACHE_MEM_FRACTION and not ns.enable_memory_saver
    assert json.loads(ns.hicache_storage_backend_extra_config)["master_server_address"] == "127.0.0.1:41000"
    req = parse_like_sglang("/generate", gpu_check.prefill_request([5, 6, 7]))
    assert req.input_ids == [5, 6, 7] and req.sampling_params["max_new_tokens"] == 1


@pytest.mark.integration
def test_tiny_gpu_check_runs_every_section_on_cpu(tmp_path):
    report = run_check(tmp_path / "tiny.json", "--tiny", timeout=600)
    check_figures(report["figures"])
    assert report["figures"]["environment"]["plan"]["device"] == "cpu"
    assert "embedded engine has no hierarchical cache" in report["figures"]["hicache"]["skipped"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_check_on_a_gpu_finishes_inside_ten_minutes(tmp_path):
    report = run_check(tmp_path / "gpu.json", timeout=600)
    check_figures(report["figures"])
    assert report["figures"]["total_s"] < 600
    assert report["figures"]["trainer"]["device"] == "cuda"
