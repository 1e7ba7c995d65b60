"""Megatron tensor and pipeline parallelism on CPU: one optimizer update of a multi-rank trainer world under
real mpirun (gloo) equals the one-process update on the same micro-batches; and the sharding helpers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.config.schema import ModelConfig
from gyre.model.random_model import random_hf_state
from gyre.model.weights import hf_to_megatron
from gyre.train.shard_weights import shard_state

sys.path.insert(0, str(Path(__file__).parent))
import model_parallel_job as job  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")
JOB = Path(__file__).parent / "model_parallel_job.py"


@pytest.fixture(scope="module")
def one_process() -> dict:
    from gyre.train.megatron_trainer import MegatronTrainer

    torch.set_num_threads(1)
    trainer = MegatronTrainer(job.CFG, job.train_config())
    trainer.load_hf_state_dict(job.initial_weights())
    batches = job.micro_batches()
    with torch.no_grad():
        before = trainer.micro_batch_logprobs(batches[1])
    metrics, grads = job.one_step(trainer, batches)
    return {"weights": trainer.hf_state_dict(), "grads": grads, "metrics": metrics, "logprobs": before}


def run_job(tmp_path: Path, script: str, ranks: int, tp: int, pp: int) -> dict:
    mpirun = Path(sys.executable).parent / "mpirun"
    assert mpirun.exists(), f"{mpirun} missing: `pip install mpi4py mpich` (tools/setup_env.sh)"
    out = tmp_path / "step.pt"
    proc = subprocess.run(
        [str(mpirun), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(JOB.with_name(script)), str(out), str(tp),
         str(pp)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def check_update(got: dict, ref: dict) -> None:
    assert ref["metrics"]["grad_norm"] > job.train_config().grad_clip  # clipping by the whole model's norm acted
    assert got["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-6)
    lr = job.train_config().lr
    for name, g in ref["grads"].items():
        if "grads" in got:
            torch.testing.assert_close(got["grads"][name], g, msg=lambda m, n=name: f"gradient of {n}: {m}")
        # AdamW's first update is lr * g / (|g| + 1e-8): where |g| is summation noise (~1e-8) the same noise
        # moves it by a fraction of lr; where |g| is well above that the update is exact to fp32
        firm = g.abs() > 1e-6
        w, want = got["weights"][name], ref["weights"][name]
        torch.testing.assert_close(w[firm], want[firm], msg=lambda m, n=name: f"updated {n}: {m}")
        assert float((w - want).abs().max()) <= 0.05 * lr, name
    moved = max(float((ref["weights"][k] - v).abs().max()) for k, v in job.initial_weights().items())
    assert moved > 0.5 * lr  # the update really moved the weights


@pytest.mark.integration
def test_a_tp2_dp2_world_update_equals_the_one_process_update(tmp_path, one_process) -> None:
    """One trainer world of 4 ranks: tensor parallel 2, data parallel 2 (megatron's groups, gloo)."""
    got = run_job(tmp_path, "model_parallel_job.py", 4, 2, 1)
    assert got["layout"] == {"tp": 2, "pp": 1, "dp": 2}
    # each TP group's first rank would send an SGLang engine its stage, merged from the TP shards, in HF names
    assert [sender for sender, _ in got["stages"]] == [True, False, True, False]
    for _, stage in got["stages"]:
        assert set(stage) == set(got["weights"]) and all(torch.equal(stage[k], v) for k, v in got["weights"].items())
    torch.testing.assert_close(got["logprobs"], one_process["logprobs"])  # fp32 defaults: rtol 1.3e-6, atol 1e-5
    check_update(got, one_process)


@pytest.mark.integration
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_a_step_of_two_cells_of_two_ranks_equals_the_one_process_update(tmp_path, one_process, tp, pp) -> None:
    """The cell runtime's layout: a controller and two cells of two ranks, each cell its own Megatron world;
    the satellite's gradients reduce to the core shard to shard, and the core steps."""
    got = run_job(tmp_path, "cell_reduce_job.py", 5, tp, pp)
    assert got["layout"] == {"tp": tp, "pp": pp, "dp": 2}
    check_update(got, one_process)
    # the satellite took the new weights shard by shard through Mooncake, each rank only its own shard
    for name, tensor in got["weights"].items():
        assert torch.equal(got["satellite_weights"][name], tensor), name
    print(f"{tp=} {pp=}: satellite ranks pulled {got['pulled_bytes']} bytes; the whole model is {got['whole_bytes']}")
    assert len(got["pulled_bytes"]) == 2 and max(got["pulled_bytes"]) < 0.75 * got["whole_bytes"]


def run_reshard_job(mode: str, directory: Path, tp: int, pp: int) -> dict:
    mpirun = Path(sys.executable).parent / "mpirun"
    proc = subprocess.run(
        [str(mpirun), "-n", "2", sys.executable, "-m", "mpi4py", str(JOB.with_name("reshard_job.py")), mode,
         str(directory), str(tp), str(pp)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(directory / f"{mode}.pt", weights_only=False)


def assert_same_state(got: dict, want: dict) -> None:
    assert got["step"] == want["step"] == 1 and got["adam_steps"] == want["adam_steps"] == [1.0]
    for part in ("weights", "exp_avg", "exp_avg_sq"):
        assert set(got[part]) == set(want[part])
        for name, tensor in want[part].items():
            assert torch.equal(got[part][name], tensor), f"{part} of {name} differs"


@pytest.mark.integration
def test_a_checkpoint_of_tensor_parallel_2_resumes_with_1_and_back(tmp_path) -> None:
    """The sharded checkpoint (torch.distributed.checkpoint) of a TP=2 world after an update: read whole in one
    process it is the world's gathered state; a one-process trainer (TP=1) loads exactly that state, weights and
    AdamW's moments; its own checkpoint loads back into TP=1 x PP=2 shards with the same whole state."""
    import reshard_job

    from gyre.model.weights import megatron_to_hf
    from gyre.train.dist_checkpoint import read_whole
    from gyre.train.megatron_trainer import MegatronTrainer

    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    tp2.mkdir(), tp1.mkdir()
    written = run_reshard_job("save", tp2, 2, 1)
    assert {p.name for p in (tp2 / "trainer").iterdir()} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    stored = read_whole(tp2 / "trainer")  # the checkpoint as one process reads it, no trainer world
    for name, tensor in megatron_to_hf(_unsplit(stored), job.CFG).items():
        assert torch.equal(tensor, written["weights"][name]), name

    trainer = MegatronTrainer(job.CFG, job.train_config())
    trainer.load(tp2 / "trainer")
    assert_same_state(reshard_job.whole_state(trainer), written)
    trainer.save(tp1 / "trainer")
    assert_same_state(run_reshard_job("load", tp1, 1, 2), written)


def _unsplit(stored: dict) -> dict:
    """read_whole's model weights in megatron's whole-model layout (linear_fc1's halves stacked)."""
    weights = {k: v for k, v in stored.items() if not k.startswith(("optimizer.", "trainer."))}
    for gate in [k for k in weights if k.endswith(".gate")]:
        base = gate.removesuffix(".gate")
        weights[base] = torch.cat([weights.pop(gate), weights.pop(base + ".up")])
    return weights


@pytest.mark.unit
def test_shards_of_each_rank_make_up_the_whole_model() -> None:
    """Tensor-parallel shards of the GLU weight are gate and up blocks of the same rows; stages renumber layers."""
    cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=4, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=24)  # fmt: skip
    full = hf_to_megatron(random_hf_state(cfg, seed=1), cfg)
    shards = {(r, p): shard_state(full, cfg, r, 2, p, 2) for r in range(2) for p in range(2)}
    fc1 = full["decoder.layers.3.mlp.linear_fc1.weight"]
    gate, up = fc1.chunk(2)
    torch.testing.assert_close(shards[1, 1]["decoder.layers.1.mlp.linear_fc1.weight"], torch.cat([gate[12:], up[12:]]))
    proj = full["decoder.layers.0.self_attention.linear_proj.weight"]
    torch.testing.assert_close(shards[1, 0]["decoder.layers.0.self_attention.linear_proj.weight"], proj[:, 8:])
    assert "embedding.word_embeddings.weight" in shards[0, 0] and "output_layer.weight" not in shards[0, 0]
    assert "output_layer.weight" in shards[0, 1] and "embedding.word_embeddings.weight" not in shards[0, 1]
    assert shards[0, 1]["output_layer.weight"].shape == (16, 16)  # half the vocabulary
    assert {k.split(".")[2] for k in shards[0, 1] if k.startswith("decoder.layers.")} == {"0", "1"}


def transformers_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.integration
def test_a_transformers_qwen3_directory_trains_with_tp2_and_is_written_back(tmp_path) -> None:
    """save_pretrained's directory (tied embeddings without lm_head, transformers 5's rope_parameters) loads
    into the tensor-parallel shards with transformers' logits; after a step the weights go back out in HF
    names, and transformers reads them with the trainer's new logits."""
    import hf_dir_job
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                         rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # norms off one, so that a dropped or swapped norm shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    hf_dir, out = tmp_path / "qwen3", tmp_path / "out"
    model.save_pretrained(hf_dir)
    out.mkdir()
    mpirun = Path(sys.executable).parent / "mpirun"
    proc = subprocess.run(
        [str(mpirun), "-n", "2", sys.executable, "-m", "mpi4py", str(JOB.with_name("hf_dir_job.py")), str(hf_dir),
         str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out / "logits.pt")
    torch.testing.assert_close(got["before"], transformers_logits(hf_dir, hf_dir_job.TOKENS))
    assert float((got["after"] - got["before"]).abs().max()) > 1e-3  # the step changed the model
    from safetensors.torch import load_file

    written = load_file(str(out / "checkpoint" / "model.safetensors"))
    assert set(load_file(str(hf_dir / "model.safetensors"))) <= set(written)  # HF names, every tensor
    torch.testing.assert_close(transformers_logits(out / "checkpoint", hf_dir_job.TOKENS), got["after"])
