"""Qwen3-style models: per-head q/k norms and a decoupled head_dim, in every place a model lives.

transformers' own Qwen3ForCausalLM is the independent reference for what a Qwen3 checkpoint means.
"""

import asyncio
import dataclasses
import json

import pytest
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.engine.client import EngineClient, SamplingParams
from gyre.engine.launcher import start_engine
from gyre.model.hf_io import hf_config, load_hf_state, load_llama, model_config_from_hf, save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.random_model import SHAPES, create_random_model, parameter_count, random_hf_state
from gyre.model.weights import hf_to_megatron, megatron_to_hf
from gyre.train.megatron_trainer import MegatronTrainer

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]

TINY = SHAPES["qwen3-tiny"]  # head_dim 32 with hidden 64 / 4 heads: decoupled on purpose
UNTIED = dataclasses.replace(TINY, tie_embeddings=False, vocab_size=300)


def perturbed(state: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor moved off its init (norms start at one), so a swapped or ignored one shows."""
    gen = torch.Generator().manual_seed(seed)
    out = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    if torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):  # keep tied weights tied
        out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
    return out


@pytest.fixture(scope="module")
def trainer() -> MegatronTrainer:
    torch.set_num_threads(1)
    tr = MegatronTrainer(UNTIED, TrainConfig(num_threads=1))
    tr.load_hf_state_dict(perturbed(tr.hf_state_dict()))
    return tr


@pytest.mark.unit
def test_qwen2_configs_are_unchanged_by_the_qwen3_options():
    cfg = ModelConfig()
    out = hf_config(cfg)
    assert out["model_type"] == "qwen2" and out["architectures"] == ["Qwen2ForCausalLM"]
    assert out["head_dim"] == cfg.hidden_size // cfg.num_attention_heads
    assert model_config_from_hf(out) == dataclasses.replace(cfg, init_std=cfg.init_std)
    assert not any("norm" in k and "self_attn" in k for k in LlamaForCausalLM(cfg).state_dict())


@pytest.mark.unit
def test_qwen3_config_round_trips_and_rejects_what_the_model_lacks():
    out = hf_config(TINY, "bfloat16", eos_token_id=2)
    assert out["model_type"] == "qwen3" and out["head_dim"] == 32 and out["torch_dtype"] == "bfloat16"
    back = model_config_from_hf(out)
    assert (back.head_dim, back.qk_layernorm, back.tie_embeddings) == (32, True, True)
    with pytest.raises(ValueError, match="attention biases"):
        model_config_from_hf({**out, "attention_bias": True})
    with pytest.raises(ValueError, match="sliding-window"):
        model_config_from_hf({**out, "use_sliding_window": True})


@pytest.mark.unit
def test_random_model_sizes_and_state():
    assert 550e6 < parameter_count(SHAPES["qwen3-0.6b"]) < 650e6  # Qwen3-0.6B: 0.6B with tied embeddings
    state = random_hf_state(TINY, seed=3)
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert torch.equal(state["model.layers.1.self_attn.q_norm.weight"], torch.ones(32))
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert abs(float(state["model.layers.0.mlp.up_proj.weight"].std()) - TINY.init_std) < 2e-3
    assert torch.equal(random_hf_state(TINY, seed=3)["model.norm.weight"], state["model.norm.weight"])


@pytest.mark.unit
def test_transformers_qwen3_loads_our_checkpoint_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = create_random_model(tmp_path / "qwen3", TINY, seed=1, dtype=torch.float32)
    _, state = load_hf_state(path)
    save_hf_checkpoint(path, perturbed(state), TINY, None)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen3ForCausalLM"
    ours = load_llama(path)
    tokens = torch.randint(0, TINY.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(tokens).logits
        got, _ = ours(tokens, torch.arange(19).expand(2, 19))
    assert (got - expected).abs().max().item() < 1e-4
    create_random_model(tmp_path / "with_tok", TINY)
    tok = AutoTokenizer.from_pretrained(tmp_path / "with_tok")
    assert json.loads((tmp_path / "with_tok" / "config.json").read_text())["eos_token_id"] == tok.eos_token_id
    assert "<|im_start|>user" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


@pytest.mark.unit
def test_megatron_qk_layernorm_converts_exactly_and_matches_the_serving_model(trainer):
    sd = {k: v for k, v in trainer.model.state_dict().items() if not k.endswith("._extra_state")}
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in sd
    assert sd["decoder.layers.0.self_attention.k_layernorm.weight"].shape == (32,)
    hf = megatron_to_hf(trainer.model.state_dict(), UNTIED)
    assert hf.keys() == LlamaForCausalLM(UNTIED).state_dict().keys()
    back = hf_to_megatron(hf, UNTIED)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    llama = LlamaForCausalLM(UNTIED)
    llama.load_state_dict(hf, strict=True)
    tokens = torch.randint(0, UNTIED.vocab_size, (3, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, _ = llama.eval()(tokens, torch.arange(17).expand(3, 17))
        got = trainer.logits(tokens)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.integration
def test_engine_logprobs_equal_trainer_logprobs_with_qk_norm(trainer, tmp_path):
    ckpt = save_hf_checkpoint(tmp_path / "v0", trainer.hf_state_dict(), UNTIED, None)
    prompts = [torch.randint(0, UNTIED.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (4, 23)]  # fmt: skip

    async def scenario(url: str) -> list:
        client = EngineClient(url)
        try:
            params = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
            return await asyncio.gather(*(client.generate(p, params) for p in prompts))
        finally:
            await client.close()

    with start_engine(ckpt, num_threads=1) as engine:
        results = asyncio.run(scenario(engine.url))
    for prompt, res in zip(prompts, results, strict=True):
        with torch.no_grad():
            ref = trainer.token_logprobs(torch.tensor([prompt + res.output_ids]))[0, len(prompt) - 1 :]
        assert len(res.output_logprobs) == 16
        assert torch.allclose(torch.tensor(res.output_logprobs), ref, atol=1e-4)
