import pytest
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.model.llama import LlamaForCausalLM
from gyre.model.weights import hf_to_megatron, megatron_to_hf
from gyre.train.megatron_trainer import MegatronTrainer

# megatron-core 0.16 deprecation notices on every forward (tp_group=None), not ours to fix.
pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]

CFG = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    rope_theta=500.0,
    norm_eps=1e-5,
    seed=7,
)


@pytest.fixture(scope="module")
def trainer() -> MegatronTrainer:
    torch.set_num_threads(1)
    tr = MegatronTrainer(CFG, TrainConfig(num_threads=1))
    # Norm weights start at one; perturb every tensor so a swapped or misplaced one cannot hide.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return tr


@pytest.fixture(scope="module")
def llama(trainer) -> LlamaForCausalLM:
    model = LlamaForCausalLM(CFG)
    model.load_state_dict(trainer.hf_state_dict(), strict=True)
    return model.eval()


def megatron_weights(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in trainer.model.state_dict().items() if not k.endswith("._extra_state")}


def test_round_trip_is_exact(trainer):
    sd = megatron_weights(trainer)
    back = hf_to_megatron(megatron_to_hf(trainer.model.state_dict(), CFG), CFG)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


def test_hf_names_match_llama(trainer):
    hf = megatron_to_hf(trainer.model.state_dict(), CFG)
    expected = LlamaForCausalLM(CFG).state_dict()
    assert hf.keys() == expected.keys()
    assert all(hf[k].shape == expected[k].shape for k in hf)


def test_qkv_layout_is_interleaved_per_query_group(trainer):
    qkv = trainer.model.state_dict()["decoder.layers.0.self_attention.linear_qkv.weight"]
    hf = megatron_to_hf(trainer.model.state_dict(), CFG)
    hd = CFG.hidden_size // CFG.num_attention_heads  # 16; 2 query heads per group
    # rows of group 1: q heads 2 and 3, then k head 1, then v head 1
    group1 = qkv[4 * hd : 8 * hd]
    assert torch.equal(group1[: 2 * hd], hf["model.layers.0.self_attn.q_proj.weight"][2 * hd : 4 * hd])
    assert torch.equal(group1[2 * hd : 3 * hd], hf["model.layers.0.self_attn.k_proj.weight"][hd : 2 * hd])
    assert torch.equal(group1[3 * hd :], hf["model.layers.0.self_attn.v_proj.weight"][hd : 2 * hd])


def test_same_logits_as_serving_model(trainer, llama):
    tokens = torch.randint(0, CFG.vocab_size, (3, 21), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        ref, _ = llama(tokens, positions)
        got = trainer.logits(tokens)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4


def test_incremental_decoding_matches_trainer_logprobs(trainer, llama):
    tokens = torch.randint(0, CFG.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    b, t = tokens.shape
    half = t // 2
    with torch.no_grad():
        expected = trainer.token_logprobs(tokens)
        logits, past = llama(tokens[:, :half], torch.arange(half).expand(b, half))
        steps = [logits]
        for i in range(half, t - 1):
            logits, new = llama(tokens[:, i : i + 1], torch.full((b, 1), i), past=past)
            past = [
                (torch.cat([pk, nk], 2), torch.cat([pv, nv], 2)) for (pk, pv), (nk, nv) in zip(past, new, strict=True)
            ]
            steps.append(logits)
    logprobs = torch.log_softmax(torch.cat(steps, dim=1), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    assert logprobs.shape == expected.shape == (b, t - 1)
    assert (logprobs - expected).abs().max().item() < 1e-4


def test_fused_norm_names_convert_to_the_same_hf_weights(trainer):
    local = trainer.model.state_dict()
    hf = megatron_to_hf(local, CFG)
    fused = hf_to_megatron(hf, CFG, fused_norms=True)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in fused
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in fused
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in fused)
    back = megatron_to_hf(fused, CFG)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_missing_and_unexpected_keys_are_named(trainer):
    sd = dict(trainer.model.state_dict())
    del sd["decoder.layers.1.mlp.linear_fc2.weight"]
    sd["decoder.layers.1.mlp.linear_fc3.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match=r"linear_fc2.*linear_fc3"):
        megatron_to_hf(sd, CFG)
    hf = megatron_to_hf(trainer.model.state_dict(), CFG)
    del hf["lm_head.weight"]
    with pytest.raises(KeyError, match="lm_head.weight"):
        hf_to_megatron(hf, CFG)


def test_wrong_config_shape_is_reported(trainer):
    hf = megatron_to_hf(trainer.model.state_dict(), CFG)
    other = ModelConfig(**{**CFG.__dict__, "ffn_hidden_size": 96})
    with pytest.raises(ValueError, match="gate_proj"):
        hf_to_megatron(hf, other)


def test_tied_embeddings_convert_and_agree(tmp_path):
    import dataclasses

    from gyre.model.hf_io import load_llama, save_hf_checkpoint

    cfg = dataclasses.replace(CFG, tie_embeddings=True)
    tr = MegatronTrainer(cfg, TrainConfig(num_threads=1))
    assert not any(k.startswith("output_layer.weight") for k in tr.model.state_dict())
    hf = tr.hf_state_dict()
    assert torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"])
    back = hf_to_megatron(hf, cfg)
    assert back.keys() == megatron_weights(tr).keys()
    model = load_llama(save_hf_checkpoint(tmp_path / "tied", hf, cfg))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        logits, _ = model(tokens, torch.arange(12).expand(2, 12))
        ref = tr.logits(tokens)
    assert torch.allclose(logits, ref, atol=1e-4)
