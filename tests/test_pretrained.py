"""model.path: a run starts from a local HF-format directory (transformers' save_pretrained, a tokenizer made
here), checked before anything starts; the engine's model and the Megatron trainer read it with transformers'
logits."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.config.load import compose
from gyre.config.validate import ConfigValueError
from gyre.metrics import read_metrics
from gyre.model.pretrained import check_pretrained
from gyre.model.random_model import default_tokenizer
from gyre.sched.controller.report import step_rows
from launch.run import check_before_start

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512
SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}  # fmt: skip


def save_model_dir(directory: Path, arch: str = "qwen3", shards: bool = True, tied: bool = True) -> Path:
    """Random weights through transformers' save_pretrained (sharded: an index and several files), norms off
    one so that a dropped norm shows; gyre's byte-level BPE tokenizer with its chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=VOCAB, tie_word_embeddings=tied, **SHAPE))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(directory, max_shard_size="100KB" if shards else "5GB")
    default_tokenizer(VOCAB).save(directory)
    return directory


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return save_model_dir(tmp_path_factory.mktemp("qwen3") / "model")


def transformers_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


TOKENS = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(1))


@pytest.mark.unit
def test_a_save_pretrained_directory_is_the_run_s_policy(qwen3_dir: Path, tmp_path: Path) -> None:
    """The directory's config.json is the architecture, its files the policy's: no warm start is built."""
    from gyre.warm_start import prepare_policy

    assert len(list(qwen3_dir.glob("model-*.safetensors"))) > 1  # sharded, with an index
    cfg = compose([f"model.path={qwen3_dir}", f"warm_start.cache_dir={tmp_path / 'cache'}"])
    model = check_pretrained(cfg)
    assert (model.vocab_size, model.hidden_size, model.num_layers, model.head_dim) == (VOCAB, 64, 2, 32)
    assert model.qk_layernorm and model.tie_embeddings and model.path == str(qwen3_dir.resolve())
    policy = prepare_policy(cfg, log=lambda _: None)
    assert policy.checkpoint_dir == policy.tokenizer_dir == qwen3_dir.resolve()
    assert not (tmp_path / "cache").exists()
    assert policy.tokenizer().eos_id == policy.tokenizer().token_id("<|im_end|>")


def _edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _drop_weight(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    index = d / "model.safetensors.index.json"
    blob = json.loads(index.read_text())
    shard = d / blob["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    tensors = load_file(shard)
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, shard, metadata={"format": "pt"})
    index.write_text(json.dumps(blob))


def _other_tokenizer(d: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["plain text"] * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"]))
    tok.save(str(d / "tokenizer.json"))


CASES = {
    "architecture": (lambda d: _edit_json(d / "config.json", architectures=["MistralForCausalLM"], model_type="mistral"),
                     [], "config.json has architectures=['MistralForCausalLM']"),
    "rope scaling": (lambda d: _edit_json(d / "config.json", rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                     [], "scaled RoPE"),
    "missing weight": (_drop_weight, [], "missing ['model.layers.1.mlp.up_proj.weight']"),
    "missing shard": (lambda d: next(d.glob("model-00002-*.safetensors")).unlink(), [], "which is missing"),
    "no chat template": (lambda d: _edit_json(d / "tokenizer_config.json", chat_template=None), [],
                         "no chat template"),
    "other chat template": (lambda d: (d / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"), [],
        "renders a conversation otherwise than gyre's proxy"),
    "other chat template accepted": (lambda d: (d / "chat_template.jinja").write_text("{{ messages }}"),
                                     ["model.chat_template=gyre"], None),
    "tokenizer without chat tokens": (_other_tokenizer, [], "tokenizer.json: tokenizer lacks special tokens"),
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), [], "tokenizer.json (a tokenizers-format"),
    "longer context": (lambda d: None, ["engine.max_context_tokens=8192"],
                       "engine.max_context_tokens=8192: exceeds model.max_position_embeddings=4096"),
    "vocab over tensor parallel": (lambda d: None, ["scheduler=colocate", "train.tensor_parallel=3",
                                   "cluster.core.tasks_per_node=3"], "train.tensor_parallel=3"),
    "not a directory": (lambda d: shutil.rmtree(d), [], "no "),
}  # fmt: skip


@pytest.mark.unit
def test_an_unknown_chat_template_choice_is_refused_where_the_config_loads() -> None:
    with pytest.raises(ConfigValueError, match="model.chat_template='jinja': choose one of directory, gyre"):
        compose(["model.chat_template=jinja"])  # the schema's domain, before any directory is read


@pytest.mark.unit
@pytest.mark.parametrize("case", list(CASES))
def test_what_the_run_cannot_honour_fails_naming_the_file_or_key(qwen3_dir: Path, tmp_path: Path, case: str) -> None:
    change, overrides, message = CASES[case]
    d = tmp_path / "model"
    shutil.copytree(qwen3_dir, d)
    change(d)
    if message is None:  # what launch.run checks before anything starts
        check_before_start(compose([f"model.path={d}", *overrides]))
        return
    with pytest.raises(ConfigValueError, match="model.path=") as err:
        check_before_start(compose([f"model.path={d}", *overrides]))
    assert message in str(err.value)


@pytest.mark.unit
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_the_engine_serves_the_directory_with_transformers_logprobs(tmp_path: Path, arch: str) -> None:
    """The embedded engine started on the directory (its loader, tokenizer, prefill and cached decode): the
    logprobs of the tokens it samples from a chat prompt are transformers' on the same sequence."""
    import asyncio

    from gyre.engine.batcher import BatcherConfig
    from gyre.engine.client import EngineClient, SamplingParams
    from gyre.engine.server import EngineServer, running
    from gyre.model.chat_template import render_text
    from gyre.model.tokenizer import Tokenizer

    d = save_model_dir(tmp_path / arch, arch, tied=arch == "qwen3")
    prompt = Tokenizer.load(d).encode(render_text([{"role": "user", "content": "Write 42 to answer.txt"}]))

    async def generate() -> tuple[list[int], list[float]]:
        server = EngineServer(str(d), BatcherConfig(max_context_tokens=512))
        async with running(server) as url:
            client = EngineClient(url, timeout_s=60)
            try:
                out = await client.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=3))
            finally:
                await client.close()
        return out.output_ids, out.output_logprobs

    ids, logprobs = asyncio.run(asyncio.wait_for(generate(), 60))
    seq = torch.tensor([prompt + ids])
    ref = torch.log_softmax(transformers_logits(d, seq[:, :-1])[0], -1).gather(1, seq[0, 1:, None])[:, 0]
    assert ids  # seeded: the same tokens every run (12 unless <|im_end|> comes first)
    torch.testing.assert_close(torch.tensor(logprobs), ref[len(prompt) - 1 :], rtol=0, atol=1e-4)


@pytest.mark.unit
def test_the_megatron_trainer_starts_from_the_directory(qwen3_dir: Path, tmp_path: Path) -> None:
    """The policy's weights in the trainer (HF names in, megatron's layout inside) give transformers' logits,
    and go back out to the engines in the directory's HF names and config."""
    from gyre.model.hf_io import load_hf_state, save_hf_checkpoint
    from gyre.train.megatron_trainer import MegatronTrainer
    from gyre.warm_start import prepare_policy

    cfg = compose([f"model.path={qwen3_dir}", "train.num_threads=1"])
    policy = prepare_policy(cfg, log=lambda _: None)
    trainer = MegatronTrainer(policy.model_cfg, cfg.train)
    trainer.load_hf_state_dict(policy.load_state())
    with torch.no_grad():
        logits = trainer.logits(TOKENS)
    torch.testing.assert_close(logits, transformers_logits(qwen3_dir, TOKENS), rtol=1e-5, atol=1e-5)
    out = save_hf_checkpoint(tmp_path / "current", trainer.hf_state_dict(), policy.model_cfg, policy.tokenizer_dir)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (out / "tokenizer.json").read_bytes() == (qwen3_dir / "tokenizer.json").read_bytes()
    _, state = load_hf_state(qwen3_dir)
    _, back = load_hf_state(out)
    assert all(torch.equal(back[k], v) for k, v in state.items())


@pytest.mark.unit
def test_the_cell_job_starts_its_cells_from_the_directory(qwen3_dir: Path, tmp_path: Path) -> None:
    """scheduler=elastic: rank 0 writes where every cell's trainer and engine start from (gyre.sched.runtime)."""
    from gyre.sched.runtime import RunStart, write_policy

    cfg = compose([f"model.path={qwen3_dir}", "scheduler=elastic"])
    assert write_policy(RunStart(cfg, tmp_path, "start-1"), None, 0) == qwen3_dir.resolve()
    paths = json.loads((tmp_path / "policy.json").read_text())
    assert paths["checkpoint_dir"] == paths["tokenizer_dir"] == str(qwen3_dir.resolve())
    assert paths["model"]["path"] == str(qwen3_dir.resolve()) and paths["model"]["vocab_size"] == VOCAB


@pytest.mark.integration
def test_main_job_trains_a_step_from_a_model_directory(qwen3_dir: Path, tmp_path: Path) -> None:
    """`python -m launch.run model.path=DIR`: rollouts from the directory's weights, a step, the engines synced
    in HF names (transformers reads what they were given), the checkpoint written."""
    out = tmp_path / "run"
    # 2 steps: the engine gets the trained weights before step 1's rollouts (after the last step none are sent)
    args = [f"model.path={qwen3_dir}", "scheduler=colocate", "steps=2", "rl.groups_per_step=1", "rl.group_size=2", "harness.max_turns=1",
            "harness.max_tokens=16", "tasks.families=[write_value]", f"output_dir={out}",
            f"hydra.run.dir={tmp_path / 'hydra'}", f"warm_start.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "launch.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"starting from the model in {qwen3_dir.resolve()} (no warm start)" in proc.stdout
    assert not (tmp_path / "cache").exists()
    rows = step_rows(read_metrics(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1] and rows[0]["n_rollouts"] == 2
    assert (out / "checkpoint" / "trainer" / ".metadata").exists()
    synced = out / "weights" / "current"
    assert json.loads((synced / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    transformers_logits(synced, TOKENS)  # loads in transformers: every HF name present, none unexpected


@pytest.mark.integration
def test_the_cell_job_refuses_a_directory_before_anything_starts(qwen3_dir: Path, tmp_path: Path) -> None:
    """`scheduler=elastic model.path=DIR`: the launcher checks the directory before it starts mpirun."""
    d = tmp_path / "model"
    shutil.copytree(qwen3_dir, d)
    (d / "tokenizer_config.json").write_text("{}")
    args = [f"model.path={d}", "scheduler=elastic", f"output_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run([sys.executable, "-m", "launch.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 1 and f"gyre: model.path={str(d)!r}: no chat template" in proc.stderr
    assert not (tmp_path / "run").exists()
