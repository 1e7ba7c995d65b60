import json
from dataclasses import dataclass

import pytest
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.train.cpu_shim import apply_cpu_shim
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.trainer import Trainer, make_trainer

# megatron-core 0.16 deprecation notices on every forward (tp_group=None), not ours to fix.
pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]

CFG = ModelConfig(
    vocab_size=61, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128
)
TRAIN = TrainConfig(lr=3e-3, grad_clip=1.0, num_threads=1)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T-1], 1 where the target token counts


def cross_entropy(share: float):
    def loss_fn(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        nll = -(logprobs * mb.mask).sum() / mb.mask.sum()
        return nll * share, {"nll": nll.item()}

    return loss_fn


def fixed_batches() -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(2):
        tokens = torch.randint(0, CFG.vocab_size, (2, 12), generator=gen)
        batches.append(MicroBatch(tokens, torch.ones(2, 11)))
    return batches


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def test_cpu_shim_is_idempotent_and_forward_leaves_cpu_rng_alone():
    MegatronTrainer(CFG, TRAIN)
    assert apply_cpu_shim() and apply_cpu_shim()
    assert torch.cuda.current_device() == "cpu"
    tr = MegatronTrainer(CFG, TRAIN)
    torch.manual_seed(11)
    expected = torch.rand(4)
    torch.manual_seed(11)
    tr.token_logprobs(fixed_batches()[0].tokens).sum().backward()
    assert torch.equal(torch.rand(4), expected)


def test_same_seed_builds_same_weights():
    a, b = MegatronTrainer(CFG, TRAIN), MegatronTrainer(CFG, TRAIN)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_train_steps_reduce_cross_entropy():
    tr = MegatronTrainer(CFG, TRAIN)
    batches = fixed_batches()
    losses = []
    for _ in range(6):
        metrics = tr.train_step(batches, cross_entropy(1 / len(batches)))
        losses.append(metrics["nll"])
    assert losses[-1] < losses[0] - 0.5, losses
    assert metrics["lr"] == TRAIN.lr and metrics["grad_norm"] > 0 and metrics["skipped_step"] == 0.0
    assert tr.step == 6
    tr.set_lr(1e-5)
    assert tr.train_step(batches, cross_entropy(0.5))["lr"] == 1e-5


def test_a_learning_rate_of_zero_trains_and_leaves_every_weight_as_it_was():
    """train.lr=0 (a frozen policy, tools/bench_schedulers.py): the step is computed, the optimizer steps,
    and no weight moves by a bit, with weight decay too (AdamW scales it by the learning rate)."""
    tr = MegatronTrainer(CFG, TrainConfig(lr=0.0, weight_decay=0.1, grad_clip=1.0, num_threads=1))
    before = [p.detach().clone() for p in tr.model.parameters()]
    for _ in range(2):
        metrics = tr.train_step(fixed_batches(), cross_entropy(0.5))
    assert tr.step == 2 and metrics["grad_norm"] > 0 and metrics["skipped_step"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, tr.model.parameters(), strict=True))


def test_gradient_is_clipped_to_grad_clip():
    tr = MegatronTrainer(CFG, TrainConfig(lr=1.0, grad_clip=0.01, num_threads=1))
    tr.zero_grad()
    tr.forward_backward(fixed_batches(), cross_entropy(0.5))
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in tr.model.named_parameters()}
    raw_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])).item()
    tr.optimizer = torch.optim.SGD(tr.model.parameters(), lr=1.0)  # plain SGD makes the update the clipped grad
    metrics = tr.optimizer_step()
    assert metrics["grad_norm"] == pytest.approx(raw_norm, rel=1e-5)
    update = torch.stack([(before[n] - p.detach()).norm() for n, p in tr.model.named_parameters()])
    assert torch.linalg.vector_norm(update).item() == pytest.approx(0.01, rel=1e-4)


def test_save_load_round_trip_resumes_identically(tmp_path):
    batches = fixed_batches()
    a = MegatronTrainer(CFG, TRAIN)
    for _ in range(2):
        a.train_step(batches, cross_entropy(0.5))
    a.save(tmp_path / "ckpt" / "trainer")

    b = MegatronTrainer(ModelConfig(**{**CFG.__dict__, "seed": 99}), TRAIN)
    b.load(tmp_path / "ckpt" / "trainer")
    assert b.step == 2
    tokens = batches[0].tokens
    with torch.no_grad():
        assert torch.equal(a.token_logprobs(tokens), b.token_logprobs(tokens))
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, state in sa["state"].items():
        assert all(torch.equal(state[k], sb["state"][i][k]) for k in state)

    # one more step from the same state gives the same weights
    a.train_step(batches, cross_entropy(0.5))
    b.train_step(batches, cross_entropy(0.5))
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))


def test_a_checkpoint_of_the_earlier_one_file_format_still_loads(tmp_path):
    """Before the sharded format a trainer checkpoint was one torch.save file, trainer.pt (layout-bound)."""
    from dataclasses import asdict

    a = MegatronTrainer(CFG, TRAIN)
    a.train_step(fixed_batches(), cross_entropy(0.5))
    weights = {k: v for k, v in a.model.state_dict().items() if not k.endswith("._extra_state")}
    old_config = json.loads(json.dumps(asdict(CFG)))  # that format's config held plain strings, not the enums
    payload = {"model": weights, "optimizer": a.optimizer.state_dict(), "step": a.step, "model_config": old_config}
    torch.save(payload | {"layout": [0, 1, 0, 1]}, tmp_path / "trainer.pt")
    b = MegatronTrainer(ModelConfig(**{**CFG.__dict__, "seed": 99}), TRAIN)
    b.load(tmp_path / "trainer.pt")
    assert b.step == 1
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))
    assert all(torch.equal(a.optimizer.state[p]["exp_avg"], b.optimizer.state[q]["exp_avg"])
               for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True))  # fmt: skip


def test_load_rejects_other_architecture(tmp_path):
    a = MegatronTrainer(CFG, TRAIN)
    a.save(tmp_path / "trainer")
    other = MegatronTrainer(ModelConfig(**{**CFG.__dict__, "num_layers": 1}), TRAIN)
    with pytest.raises(ValueError, match="num_layers"):
        other.load(tmp_path / "trainer")


def test_right_padding_leaves_real_token_logprobs_unchanged():
    tr = MegatronTrainer(CFG, TRAIN)
    gen = torch.Generator().manual_seed(5)
    short, long = (
        torch.randint(1, CFG.vocab_size, (7,), generator=gen),
        torch.randint(1, CFG.vocab_size, (13,), generator=gen),
    )
    padded = torch.zeros(2, 13, dtype=torch.long)
    padded[0, :7], padded[1] = short, long
    with torch.no_grad():
        batch = tr.token_logprobs(padded)
        alone_short = tr.token_logprobs(short[None])[0]
        alone_long = tr.token_logprobs(long[None])[0]
    assert batch.shape == (2, 12)
    assert torch.allclose(batch[0, :6], alone_short, atol=1e-5, rtol=0)
    assert torch.allclose(batch[1], alone_long, atol=1e-5, rtol=0)


def test_hf_state_dict_round_trips_through_load():
    a = MegatronTrainer(CFG, TRAIN)
    a.train_step(fixed_batches(), cross_entropy(0.5))
    b = MegatronTrainer(CFG, TRAIN)
    b.load_hf_state_dict(a.hf_state_dict())
    tokens = fixed_batches()[1].tokens
    with torch.no_grad():
        assert torch.equal(a.token_logprobs(tokens), b.token_logprobs(tokens))


def test_make_trainer_builds_the_configured_backend_behind_the_trainer_protocol():
    trainer = make_trainer(CFG, TRAIN)
    assert isinstance(trainer, MegatronTrainer) and isinstance(trainer, Trainer)
    before = {k: v.clone() for k, v in trainer.hf_state_dict().items()}
    metrics = trainer.train_step(fixed_batches(), cross_entropy(0.5))
    assert trainer.step == 1 and metrics["lr"] == pytest.approx(TRAIN.lr)
    assert any(not torch.equal(before[k], v) for k, v in trainer.hf_state_dict().items())


def test_make_trainer_refuses_a_backend_it_has_no_trainer_for():
    odd = TrainConfig(num_threads=1)
    object.__setattr__(odd, "backend", "deepspeed")  # past the schema's own check, as a new enum value would be
    with pytest.raises(ValueError, match="train.backend='deepspeed'"):
        make_trainer(CFG, odd)
