"""rl.mismatch in a real training step: rollouts sampled by the real embedded engine, written to a real shard,
trained by the real megatron trainer with proximal=trainer. On the embedded path engine and trainer agree, so
the ratio is 1 and nothing is masked; with the shard's recorded engine logprobs perturbed (the file edited,
its checksum renewed), masking and truncation hit exactly the tokens and rollouts a hand computation from the
shard says."""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from gyre.config.schema import MismatchConfig, ModelConfig, TrainConfig
from gyre.engine.client import EngineClient, SamplingParams
from gyre.engine.launcher import start_engine
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.tokenizer import Tokenizer
from gyre.pipeline import rl_micro_batches, tree_gspo_loss_fn
from gyre.proxy.call_log import CallRecord
from gyre.store.reader import read_shard
from gyre.store.schema import TABLES, RolloutMeta, checksum
from gyre.store.writer import ShardWriter
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.traj.build import build_tree
from gyre.traj.sampling import sample_tree
from gyre.traj.synthetic import make_record

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]
METRICS = ("kl_k3", "ratio_p05", "ratio_p50", "ratio_p95", "seq_ratio_min", "seq_ratio_max", "masked_frac",
           "truncated_frac")  # fmt: skip


async def sample_rollout(url: str, rid: str, prompt: list[int], seed: int) -> list[CallRecord]:
    """Two calls on one path and a branch off the prompt, at temperature 1."""
    client = EngineClient(url)
    records: list[CallRecord] = []
    try:
        context = list(prompt)
        for n, ids in enumerate((None, None, prompt[:4]), 1):
            ids = context if ids is None else ids
            res = await client.generate(ids, SamplingParams(temperature=1.0, max_new_tokens=10, seed=seed + n))
            records.append(make_record(n, ids, res.output_ids, logprobs=res.output_logprobs, rollout_id=rid))
            context = ids + res.output_ids + prompt[:3]
    finally:
        await client.close()
    return records


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("mismatch")
    tok = Tokenizer.train([f"Write the value {i} into out_{i % 7}.txt and stop." for i in range(200)], 320)
    tok.save(root / "tok")
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128)  # fmt: skip
    trainer = MegatronTrainer(cfg, TrainConfig(lr=1e-2, num_threads=1))
    start = trainer.hf_state_dict()
    engine = start_engine(save_hf_checkpoint(root / "v0", start, cfg, root / "tok"), num_threads=1)
    shard = root / "step00000-group0000.h5"
    try:
        with ShardWriter(shard, run_id="mismatch", step=0) as w:
            for i, adv in enumerate((1.0, -1.0)):
                prompt = tok.encode(f"Write the value {3 + i} into out_{i}.txt")
                records = asyncio.run(sample_rollout(engine.url, f"r{i}", prompt, seed=10 * i))
                meta = RolloutMeta("s0-g0", f"t{i}", "f", "builtin", "ok", 0.5 + adv / 2, 0.5 + adv / 2, adv)
                w.add(sample_tree(build_tree(f"r{i}", records)), meta)
    finally:
        engine.stop()
    yield trainer, start, shard


def train(trainer: MegatronTrainer, start: dict, shard: Path, mismatch: MismatchConfig) -> dict[str, float]:
    """One step on the shard from the weights that sampled it (every test starts there)."""
    trainer.load_hf_state_dict(start)
    rollouts = list(read_shard(shard).trainable())
    batches = rl_micro_batches(rollouts, 100_000, trainer.model_cfg.max_position_embeddings, len(rollouts))
    assert len(batches) == 1  # the metrics are this micro-batch's, not an average
    return trainer.train_step(batches, tree_gspo_loss_fn(0.2, 0.2, mismatch))


def perturbed(shard: Path, out: Path, shift: dict[int, float]) -> Path:
    """A copy of the shard whose recorded engine logprobs at token rows `shift` are moved by its values (crc32 renewed)."""
    shutil.copy(shard, out)
    with h5py.File(out, "r+") as f:
        ds = f["tokens/logprob"]
        values = ds[()]
        for row, delta in shift.items():
            values[row] += delta
        ds[...] = values
        (col,) = [c for c in TABLES["tokens"] if c.name == "logprob"]
        ds.attrs["crc32"] = checksum(values, col)
    return out


def targets_of(shard: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows of the trained targets, their loss weights, their rollout) read from the file."""
    with h5py.File(shard, "r") as f:
        weight = f["tokens/loss_weight"][()]
        n_tokens = f["rollouts/n_tokens"][()]
    rollout = np.repeat(np.arange(len(n_tokens)), n_tokens)
    rows = np.flatnonzero(weight > 0)
    return rows, weight[rows], rollout[rows]


def k3(log_ratio: np.ndarray) -> float:
    return float(np.mean(np.exp(log_ratio) - 1.0 - log_ratio))


def test_on_the_embedded_path_the_ratio_is_one_and_nothing_is_masked(stack):
    trainer, start, shard = stack
    m = train(trainer, start, shard, MismatchConfig(proximal="trainer", correction="mask"))
    assert {f"mismatch/{k}" for k in METRICS} <= set(m)
    assert m["ratio_mean"] == 1.0 and m["clip_frac"] == 0.0  # GSPO's ratio at the first micro-batch: exactly 1
    for k in ("ratio_p05", "ratio_p50", "ratio_p95", "seq_ratio_min", "seq_ratio_max"):
        assert m[f"mismatch/{k}"] == pytest.approx(1.0, abs=1e-5), k
    assert m["mismatch/masked_frac"] == 0.0 and m["mismatch/kl_k3"] < 1e-9
    assert m["skipped_step"] == 0.0 and m["grad_norm"] > 0


def test_perturbed_engine_logprobs_are_masked_and_truncated_as_computed_by_hand(stack, tmp_path):
    trainer, start, shard = stack
    rows, weight, rollout = targets_of(shard)
    n = len(rows)
    # pi_engine raised e^1.5 (rho 0.22), lowered e^1 (rho 2.72) and e^0.3 (rho 1.35) on three targets of rollout 0
    first = rows[rollout == 0]
    shift = {int(first[0]): 1.5, int(first[1]): -1.0, int(first[2]): -0.3}
    bad = perturbed(shard, tmp_path / "step00000-group0001.h5", shift)
    log_rho = np.array([-shift.get(int(r), 0.0) for r in rows])  # trainer == engine elsewhere (1e-6)

    m = train(trainer, start, bad, MismatchConfig(proximal="trainer", correction="mask", low=0.5, high=2.0))
    assert m["ratio_mean"] == 1.0
    assert m["mismatch/masked_frac"] == pytest.approx(2 / n, abs=1e-12)  # rho 0.22 and 2.72 out of [0.5, 2]
    assert m["mismatch/kl_k3"] == pytest.approx(k3(log_rho), rel=1e-4)
    assert m["mismatch/kl_k3"] > 0.01

    m = train(trainer, start, bad, MismatchConfig(proximal="trainer", correction="tis", cap=2.0))
    assert m["mismatch/truncated_frac"] == pytest.approx(1 / n, abs=1e-12)  # rho 2.72 cut to 2
    assert m["mismatch/masked_frac"] == 0.0

    # sequence level: rollout 0's geometric-mean ratio, from the file's loss weights; a band that just misses it
    share = weight[rollout == 0] / weight[rollout == 0].sum()
    seq = math.exp(float(np.dot(share, log_rho[rollout == 0])))
    assert abs(seq - 1.0) > 1e-3
    band = (0.5, 1 + (seq - 1) / 2) if seq > 1 else (1 - (1 - seq) / 2, 2.0)
    m = train(trainer, start, bad, MismatchConfig(proximal="trainer", correction="mask", level="sequence",
                                                  low=band[0], high=band[1]))  # fmt: skip
    assert m["mismatch/masked_frac"] == pytest.approx(float(np.mean(rollout == 0)), abs=1e-12)  # all of rollout 0
    assert m["mismatch/seq_ratio_max" if seq > 1 else "mismatch/seq_ratio_min"] == pytest.approx(seq, rel=1e-5)
