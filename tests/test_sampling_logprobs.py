"""Training logprobs of the distribution each token was sampled from: the pure function against a hand-written
reference, the per-token parameters of a tree, and the real embedded engine against the real megatron trainer
on a tree whose calls used different temperatures (through the proxy and directly)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import numpy as np
import openai
import pytest
import torch

from gyre.config.schema import LogprobDistribution, ModelConfig, ProxyConfig, TrainConfig
from gyre.engine.client import EngineClient, SamplingParams
from gyre.engine.launcher import start_engine
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.tokenizer import Tokenizer
from gyre.pipeline import RLMicroBatch, rollout_log_ratios, tree_gspo_loss_fn
from gyre.proxy.call_log import CallLog, CallRecord
from gyre.proxy.server import ProxyServer
from gyre.proxy.synthetic import make_record
from gyre.train.megatron_trainer import MegatronTrainer
from gyre.train.sampling_logprobs import TokenSampling, sampled_token_logprobs, tree_sampling_table
from gyre.train.tree_pack import TreeMicroBatch, pack_forest
from gyre.traj.build import build_tree
from gyre.traj.sampling import sample_tree

TOL = 1e-4  # fp32 engine vs trainer


# ----- the pure function against a per-row reference written from the definition -----


def reference_logprob(logits: list[float], target: int, t: float, top_p: float, top_k: int, min_p: float,
                      truncated: bool) -> float:  # fmt: skip
    z = [x / t for x in logits]
    m = max(z)
    total = sum(math.exp(x - m) for x in z)
    p = [math.exp(x - m) / total for x in z]
    if not truncated:
        return math.log(p[target])
    kept, before = set(), 0.0
    for rank, i in enumerate(sorted(range(len(p)), key=lambda i: -p[i])):
        in_k = top_k <= 0 or rank < top_k
        in_p = rank == 0 or before < top_p
        if in_k and in_p and p[i] >= min_p * max(p):
            kept.add(i)
        before += p[i]
    kept.add(target)
    return math.log(p[target] / sum(p[i] for i in kept))


@pytest.mark.unit
def test_sampled_token_logprobs_match_the_definition_row_by_row():
    torch.manual_seed(0)
    n, v = 8, 11
    logits = torch.randn(n, v, dtype=torch.float64) * 2
    targets = torch.randint(0, v, (n,))
    targets[6] = logits[6].argmax()  # the token a greedy (top-k 1) call produces
    temperature = torch.tensor([0.7, 1.6, 1.0, 0.7, 1.6, 0.3, 1.0, 2.0])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 0.8, 1.0, 1.0, 0.95])
    top_k = torch.tensor([-1, -1, 3, 2, 5, -1, 1, 4])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.05, 0.5, 0.0, 0.1])
    for truncated in (False, True):
        got = sampled_token_logprobs(logits, targets, TokenSampling(temperature, top_p, top_k, min_p, truncated))
        ref = [
            reference_logprob(
                logits[i].tolist(),
                int(targets[i]),
                float(temperature[i]),
                float(top_p[i]),
                int(top_k[i]),
                float(min_p[i]),
                truncated,
            )  # fmt: skip
            for i in range(n)
        ]
        np.testing.assert_allclose(got.numpy(), ref, atol=1e-5)
    assert got[6].item() == 0.0  # top-k 1 (a greedy call): the kept set is the target alone


@pytest.mark.unit
def test_truncated_logprobs_stay_finite_and_differentiable_outside_the_kept_set():
    logits = torch.tensor([[3.0, 2.0, -4.0]], requires_grad=True)
    sampling = TokenSampling(torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([1]), torch.tensor([0.0]), True)
    logp = sampled_token_logprobs(logits, torch.tensor([2]), sampling)  # token 2 is outside top-1
    logp.sum().backward()
    assert math.isfinite(logp.item()) and torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0
    assert logp.item() == pytest.approx(math.log(math.exp(-4) / (math.exp(3) + math.exp(-4))), abs=1e-6)


@pytest.mark.unit
def test_tree_tokens_take_their_calls_sampling_parameters():
    records = [
        replace(make_record(1, [1, 2], [10, 11]), temperature=0.7, top_p=0.9),
        replace(make_record(2, [1, 2, 10, 11, 3], [12]), temperature=1.6, top_k=20, min_p=0.05),
        replace(make_record(3, [1, 4], [13]), temperature=0.0),  # greedy: temperature 1, top-k 1
    ]
    tree = build_tree("r", records)
    table = tree_sampling_table(tree)
    by_token = {int(t): tuple(row) for t, row in zip(tree.tokens, table, strict=True)}
    assert by_token[10] == by_token[11] == (0.7, 0.9, -1, 0.0)
    assert by_token[12] == (1.6, 1.0, 20, 0.05)
    assert by_token[13] == (1.0, 1.0, 1, 0.0)
    assert by_token[1] == by_token[3] == (1.0, 1.0, -1, 0.0)  # context


@pytest.mark.unit
def test_a_sampled_retry_keeps_the_call_that_generated_its_shared_first_tokens():
    """Call 1's reply is dropped and retried; call 2 shares its first tokens (they stay call 1's)."""
    records = [
        replace(make_record(1, [1, 2], [10, 11, 12]), temperature=0.7),
        replace(make_record(2, [1, 2], [10, 11, 14], role="main_summary"), temperature=1.6),
    ]
    tree = build_tree("r", records)
    sampled = sample_tree(tree, k=1, roles=("main_summary",)).tree  # only call 2's path
    assert 12 not in sampled.tokens.tolist() and {c.call_id for c in sampled.calls} == {1, 2}
    sampled.validate()
    temps = dict(zip(sampled.tokens.tolist(), tree_sampling_table(sampled)[:, 0].tolist(), strict=True))
    assert (temps[10], temps[11], temps[14]) == (0.7, 0.7, 1.6)


# ----- the real engine against the real trainer -----


def policy_diff(trainer: MegatronTrainer, mb: TreeMicroBatch) -> float:
    with torch.no_grad():
        logp = trainer.tree_token_logprobs(mb)
    return float((logp - mb.old_logprobs)[mb.policy_mask].abs().max())


def neutral(sampling: TokenSampling) -> TokenSampling:
    """The untempered definition (what gyre trained before): temperature 1 everywhere, no truncation."""
    return replace(sampling, temperature=torch.ones_like(sampling.temperature), truncated=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("sampling_logprobs")
    tok = Tokenizer.train([f"Write the value {i} into out_{i % 7}.txt and stop." for i in range(200)], 320)
    tok.save(root / "tok")
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128)  # fmt: skip
    trainer = MegatronTrainer(cfg, TrainConfig(lr=1e-2, num_threads=1))
    ckpt = save_hf_checkpoint(root / "v0", trainer.hf_state_dict(), cfg, root / "tok")
    engine = start_engine(ckpt, num_threads=1)
    try:
        yield tok, trainer, engine
    finally:
        engine.stop()


def proxy_rollout(tok: Tokenizer, url: str, truncated: bool = False) -> list[CallRecord]:
    """A harness-shaped rollout through the proxy: a turn at 0.7, a follow-up at 1.6 on the same path (its
    prompt splices the first reply), and a compaction-like branch at 1.6 with top-p 0.9."""
    server = ProxyServer(tok, [url], ProxyConfig(), CallLog(), truncated_logprobs=truncated)
    base = server.start()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        first = [{"role": "user", "content": "Write the value 4 into out_4.txt"}]
        reply = client.chat.completions.create(model="m", messages=first, max_tokens=12, temperature=0.7, seed=1)
        follow = [*first, {"role": "assistant", "content": reply.choices[0].message.content or ""},
                  {"role": "user", "content": "and stop."}]  # fmt: skip
        client.chat.completions.create(model="m", messages=follow, max_tokens=12, temperature=1.6, seed=2)
        branch = [{"role": "user", "content": "Write the value 9"}]
        client.chat.completions.create(model="m", messages=branch, max_tokens=12, temperature=1.6, top_p=0.9, seed=3)
        return server.call_log.for_rollout("default")
    finally:
        server.stop()


async def engine_rollout(url: str, prompt: list[int], truncated: bool) -> list[CallRecord]:
    """Calls sent straight to the engine with top-k / top-p / min-p, a path at 0.7 then 1.6 plus a greedy branch."""
    client = EngineClient(url)
    calls = [
        SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_new_tokens=10, seed=5),
        SamplingParams(temperature=1.6, top_k=40, min_p=0.02, max_new_tokens=10, seed=6),
        SamplingParams(temperature=0.0, max_new_tokens=6),
    ]
    records: list[CallRecord] = []
    try:
        context = list(prompt)
        for n, params in enumerate(calls, 1):
            ids = context if n < 3 else prompt[:4]
            res = await client.generate(ids, replace(params, truncated_logprobs=truncated))
            rec = make_record(n, ids, res.output_ids, logprobs=res.output_logprobs)
            records.append(replace(rec, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                   min_p=params.min_p))  # fmt: skip
            context = ids + res.output_ids + prompt[:3]
    finally:
        await client.close()
    return records


@pytest.mark.integration
def test_engine_behaviour_logprobs_equal_trainer_logprobs_at_temperatures_0_7_and_1_6(stack):
    tok, trainer, engine = stack
    records = proxy_rollout(tok, engine.url)
    assert sorted({r.temperature for r in records}) == [0.7, 1.6] and records[2].top_p == 0.9
    tree = build_tree("default", records)
    assert tree.calls[1].leaf > tree.calls[0].leaf and len(tree.leaves()) == 2  # a shared path and a branch
    mb = pack_forest([tree])
    assert sorted(set(mb.sampling.temperature[mb.policy_mask].tolist())) == pytest.approx([0.7, 1.6])
    assert policy_diff(trainer, mb) < TOL  # tempered (the default): top-p 0.9 on the branch ignored
    mb.sampling = neutral(mb.sampling)
    assert policy_diff(trainer, mb) > 100 * TOL  # negative check: the untempered definition fails this test
    mb = pack_forest([build_tree("default", proxy_rollout(tok, engine.url, truncated=True))])
    mb.sampling = replace(mb.sampling, truncated=True)  # rl.logprob_distribution=truncated: top-p 0.9 renormalised
    assert policy_diff(trainer, mb) < TOL

    prompt = tok.encode("Write the value 12 into out_5.txt")
    for truncated in (False, True):
        tree = build_tree("r", asyncio.run(engine_rollout(engine.url, prompt, truncated)))
        mb = pack_forest([tree])
        mb.sampling = replace(mb.sampling, truncated=truncated)
        assert policy_diff(trainer, mb) < TOL, f"truncated={truncated}"
        mb.sampling = replace(mb.sampling, truncated=not truncated)  # the other definition
        assert policy_diff(trainer, mb) > 100 * TOL, f"a {truncated=} engine scored the other way must fail"


@pytest.mark.integration
def test_the_importance_ratio_is_one_on_policy_at_temperature_1_6_in_a_real_step(stack):
    tok, trainer, engine = stack
    prompt = tok.encode("Write the value 3 into out_3.txt")

    async def sample() -> list[CallRecord]:
        client = EngineClient(engine.url)
        try:
            out = []
            for n, t in enumerate((1.6, 1.6), 1):
                res = await client.generate(prompt, SamplingParams(temperature=t, max_new_tokens=12, seed=n))
                out.append(replace(make_record(n, prompt, res.output_ids, logprobs=res.output_logprobs), temperature=t))
            return out
        finally:
            await client.close()

    sampled = sample_tree(build_tree("r", asyncio.run(sample())))
    mb = RLMicroBatch(pack_forest([sampled.tree], [sampled.loss_weight]), torch.tensor([1.0]), 1.0)
    with torch.no_grad():
        untempered = rollout_log_ratios(
            trainer.tree_token_logprobs(replace(mb.batch, sampling=neutral(mb.batch.sampling))), mb
        )
    # what the ratio was with an untempered trainer: far outside GSPO's clip window, so the update was clipped away
    assert abs(math.exp(float(untempered[0])) - 1) > 10 * 4e-4
    metrics = trainer.train_step([mb], tree_gspo_loss_fn(3e-4, 4e-4))
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=TOL) and metrics["clip_frac"] == 0.0
    assert metrics["skipped_step"] == 0.0 and metrics["grad_norm"] > 0


@pytest.mark.unit
def test_rl_micro_batches_apply_the_configured_distribution():
    from gyre.pipeline import rl_micro_batches
    from gyre.store.reader import ShardRollout
    from gyre.store.schema import RolloutMeta

    tree = build_tree("r", [replace(make_record(1, [1, 2], [10, 11]), temperature=0.7, top_k=5)])
    meta = RolloutMeta("g", "t", "f", "builtin", "ok", 1.0, 1.0, 0.5)
    rollout = ShardRollout(tree, sample_tree(tree).loss_weight, meta, "s.h5")
    for dist in LogprobDistribution:
        (mb,) = rl_micro_batches([rollout], 64, 64, 1, dist)
        assert mb.batch.sampling.truncated == (dist is LogprobDistribution.truncated)
        assert mb.batch.sampling.temperature[mb.batch.policy_mask].tolist() == pytest.approx([0.7, 0.7])


@pytest.mark.unit
def test_call_log_lines_carry_sampling_parameters_and_older_lines_read_as_defaults(tmp_path):
    from gyre.proxy.call_log import read_call_log

    log = CallLog(tmp_path / "calls.jsonl")
    log.add(replace(make_record(1, [1, 2], [3]), temperature=0.7, top_p=0.9, top_k=20, min_p=0.05))
    (back,) = read_call_log(tmp_path / "calls.jsonl")
    assert (back.temperature, back.top_p, back.top_k, back.min_p) == (0.7, 0.9, 20, 0.05)
    row = back.to_json()
    for name in ("temperature", "top_p", "top_k", "min_p"):
        del row[name]  # a line written before they were recorded
    old = CallRecord.from_json(row)
    assert (old.temperature, old.top_p, old.top_k, old.min_p) == (1.0, 1.0, -1, 0.0)
