"""Qwen3-MoE models (gyre/model/llama.py SparseMoE, megatron's MoE layer in training) against transformers'
Qwen3MoeForCausalLM, the independent reference for what a Qwen3-MoE checkpoint means."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gyre.model.hf_io import load_hf_state, load_llama, model_config_from_hf, save_hf_checkpoint
from gyre.model.moe import moe_layer_indices
from gyre.model.pretrained import expected_hf_shapes
from gyre.model.random_model import SHAPES, create_random_model

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*")]

ROOT = Path(__file__).resolve().parents[1]
TINY_MOE = SHAPES["qwen3-moe-tiny"]


def perturbed(state: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor off its init (norms at one, a near-uniform router), so a swapped or ignored one shows."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> object:
    path = create_random_model(tmp_path_factory.mktemp("moe") / "qwen3-moe", TINY_MOE, seed=1, dtype=torch.float32)
    _, state = load_hf_state(path)
    return save_hf_checkpoint(path, perturbed(state), TINY_MOE, path)


@pytest.mark.unit
def test_moe_config_round_trips_with_its_sparse_layers():
    sparse = dataclasses.replace(TINY_MOE, num_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert moe_layer_indices(sparse) == [1]  # (i + 1) % 2 == 0 picks 1 and 3; 3 is listed dense
    from gyre.model.hf_io import hf_config

    out = hf_config(sparse)
    assert (out["architectures"], out["model_type"]) == (["Qwen3MoeForCausalLM"], "qwen3_moe")
    assert model_config_from_hf(out) == sparse
    shapes = expected_hf_shapes(sparse)
    assert shapes["model.layers.1.mlp.gate.weight"] == (4, 64)
    assert shapes["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 64)
    assert shapes["model.layers.3.mlp.up_proj.weight"] == (128, 64)  # dense layers keep intermediate_size
    with pytest.raises(ValueError, match="shared experts"):
        model_config_from_hf({**out, "shared_expert_intermediate_size": 32})


@pytest.mark.unit
def test_transformers_qwen3_moe_loads_our_directory_with_the_same_logits(moe_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Qwen3MoeForCausalLM"
    ours = load_llama(moe_dir)
    tokens = torch.randint(0, TINY_MOE.vocab_size, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(tokens).logits
        got, _ = ours(tokens, torch.arange(19).expand(2, 19))
    assert (got - expected).abs().max().item() < 1e-4
    routed = ours.model.layers[0].mlp.routed
    assert routed.shape == (2, 19, 2) and len(routed.unique()) > 2  # tokens reach more than two experts


@pytest.fixture(scope="module")
def moe_trainer(moe_dir):
    from gyre.config.schema import TrainConfig
    from gyre.train.megatron_trainer import MegatronTrainer

    torch.set_num_threads(1)
    tr = MegatronTrainer(TINY_MOE, TrainConfig(num_threads=1))
    tr.load_hf_state_dict(load_hf_state(moe_dir)[1])
    return tr


@pytest.mark.unit
def test_megatron_moe_weights_convert_exactly_and_logprobs_equal_transformers(moe_dir, moe_trainer):
    from transformers import AutoModelForCausalLM

    from gyre.model.weights import hf_to_megatron, megatron_to_hf

    sd = {k: v for k, v in moe_trainer.model.state_dict().items() if not k.endswith("._extra_state")}
    assert "decoder.layers.1.mlp.router.weight" in sd and "decoder.layers.0.mlp.linear_fc1.weight" not in sd
    hf = moe_trainer.hf_state_dict()
    assert all(torch.equal(hf[k], v) for k, v in load_hf_state(moe_dir)[1].items())  # loaded and saved in HF names
    back = hf_to_megatron(hf, TINY_MOE)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    assert megatron_to_hf(back, TINY_MOE).keys() == hf.keys()
    ref = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, TINY_MOE.vocab_size, (2, 23), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = torch.log_softmax(ref(tokens).logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
        got = moe_trainer.token_logprobs(tokens)
    assert (got - expected).abs().max().item() < 1e-5


CELLS_OF_TWO_EP2 = ["scheduler=colocate_cells", "cluster.core.tasks_per_node=2", "cluster.satellites=[{tasks_per_node:2}]",
                    "train.expert_parallel=2"]  # fmt: skip


@pytest.mark.integration
@pytest.mark.parametrize("layout", [["scheduler=colocate"], CELLS_OF_TWO_EP2], ids=["colocate", "cells_of_2_ep2"])
def test_a_random_qwen3_moe_directory_trains_an_rl_step(tmp_path: Path, layout: list[str]) -> None:
    """`python -m gyre.model.random_model --shape qwen3-moe-tiny` then `python -m launch.run model.path=DIR`: rollouts
    from the embedded engine's MoE model, one step of megatron's MoE layer (in colocate, or in cells of 2 ranks each
    holding half the experts), the checkpoint written. With rl.routing_replay on: the shards carry every token's
    routed experts, and the trainer replaying them gives each trained token the engine's logprob within 1e-5."""
    from gyre.metrics import read_metrics
    from gyre.sched.controller.report import step_rows
    from tools.check_trained_tokens import check_run

    model, out = tmp_path / "qwen3-moe", tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    made = subprocess.run([sys.executable, "-m", "gyre.model.random_model", str(model), "--shape", "qwen3-moe-tiny"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    args = [f"model.path={model}", *layout, "rl.routing_replay=true", "steps=1", "rl.groups_per_step=1", "rl.group_size=2",
            "harness.max_turns=1", "harness.max_tokens=16", "tasks.families=[write_value]", f"output_dir={out}",
            f"hydra.run.dir={tmp_path / 'hydra'}", f"warm_start.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "launch.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = step_rows(read_metrics(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0] and rows[0]["n_rollouts"] == 2
    assert (out / "checkpoint" / "trainer" / ".metadata").exists()
    n_rollouts, n_tokens, problems = check_run(out)  # the trained tokens are the calls' sampled ones
    assert not problems and n_rollouts == 2 and n_tokens > 0
    assert_replay_gives_the_engine_s_logprobs(model, out)


def assert_replay_gives_the_engine_s_logprobs(model_dir: Path, run: Path) -> None:
    """Every stored tree of the run carries routed experts for every token the engine ran (all but leaves' last), and
    the trainer on the run's starting weights, replaying them, gives each trained token its behaviour logprob."""
    from gyre.config.schema import TrainConfig
    from gyre.store.reader import read_shard
    from gyre.train.megatron_trainer import MegatronTrainer
    from gyre.train.tree_pack import pack_forest

    cfg, state = load_hf_state(model_dir)
    trainer = MegatronTrainer(cfg, TrainConfig(num_threads=1))
    trainer.load_hf_state_dict(state)
    trees = [r.tree for shard in sorted((run / "shards").glob("*.h5")) for r in read_shard(shard)]
    assert trees
    for tree in trees:
        ran = np.ones(tree.n_tokens, bool)
        ran[tree.leaves()] = False
        assert tree.routed_experts is not None and (tree.routed_experts[ran] >= 0).all()
        assert (tree.routed_experts[ran] < cfg.num_experts).all()
        mb = pack_forest([tree])
        with torch.no_grad():
            logp = trainer.micro_batch_logprobs(mb)
        policy = torch.from_numpy(tree.policy)[mb.source_index]
        engine = torch.from_numpy(tree.logprob)[mb.source_index]
        assert policy.any() and (logp - engine)[policy].abs().max().item() < 1e-5


@pytest.mark.integration
def test_expert_parallel_2_update_equals_the_one_process_update(tmp_path: Path) -> None:
    """train.expert_parallel=2 over 2 gloo ranks (a cell's layout: both train every micro-batch): logprobs,
    gradients, the clipped norm and the update equal one process's; the checkpoint loads into one process."""
    sys.path.insert(0, str(Path(__file__).parent))
    import expert_parallel_job as ep_job
    import model_parallel_job as job

    from gyre.train.megatron_trainer import MegatronTrainer

    mpirun = Path(sys.executable).parent / "mpirun"
    out = tmp_path / "step.pt"
    proc = subprocess.run(
        [str(mpirun), "-n", "2", sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "expert_parallel_job.py"), str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=False)
    assert got["layout"] == {"ep": 2, "local_expert_weights": 2 * 2 * 2}  # 2 layers x 2 experts x (fc1, fc2)
    trainer = MegatronTrainer(ep_job.CFG, ep_job.train_config())
    trainer.load_hf_state_dict(ep_job.initial_weights())
    batches = job.micro_batches()
    with torch.no_grad():
        torch.testing.assert_close(got["logprobs"], trainer.micro_batch_logprobs(batches[1]))
    metrics, grads = job.one_step(trainer, batches)
    assert metrics["grad_norm"] > ep_job.train_config().grad_clip  # clipping by the whole model's norm acted
    assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(got["grads"][name], g, msg=lambda m, n=name: f"gradient of {n}: {m}")
    want = trainer.hf_state_dict()
    for name, w in want.items():
        assert float((got["weights"][name] - w).abs().max()) <= 0.05 * ep_job.train_config().lr, name
    trainer.load(tmp_path / "trainer")  # the EP=2 checkpoint, experts under their global names, into one process
    assert all(torch.equal(trainer.hf_state_dict()[k], v) for k, v in got["weights"].items())


@pytest.mark.unit
@pytest.mark.parametrize(
    ("model", "overrides", "key", "why"),
    [
        ("dense", ["train.expert_parallel=2"], "train.expert_parallel", "this model is dense"),
        ("dense", ["rl.routing_replay=true"], "rl.routing_replay", "this model is dense"),
        ("moe", ["train.expert_parallel=3"], "train.expert_parallel", "must divide model.num_experts=4"),
        ("moe", ["train.tensor_parallel=2"], "train.tensor_parallel", "not split over tensor-parallel ranks"),
        ("moe", ["train.transformer_engine=on"], "train.transformer_engine", "local spec"),
        (
            "moe",
            ["scheduler=elastic", "train.expert_parallel=2"],
            "cluster.core.tasks_per_node",
            "x expert_parallel = 2",
        ),
    ],
)
def test_what_the_trainer_cannot_honour_of_experts_is_refused_naming_the_key(moe_dir, model, overrides, key, why):
    from gyre.config.load import compose
    from gyre.config.validate import ConfigValueError
    from launch.run import check_before_start

    path = [f"model.path={moe_dir}"] if model == "moe" else []
    with pytest.raises(ConfigValueError, match=key) as err:
        check_before_start(compose([*path, "scheduler=colocate", *overrides]))
    assert why in str(err.value)


def engine_with_shifted_routing(moe_dir, seed: int = 3):
    """The embedded engine's model of the directory whose routers choose with a small per-expert shift of their
    probabilities (a stand-in for the engine's own numerics: its choice moves at near ties), weighting the chosen
    experts by the unshifted probabilities."""
    from gyre.model.llama import SparseMoE

    model = load_llama(moe_dir)
    gen = torch.Generator().manual_seed(seed)
    for layer in model.modules():
        if isinstance(layer, SparseMoE):
            shift = 0.08 * torch.randn(TINY_MOE.num_experts, generator=gen)
            layer.select = lambda probs, k=layer.top_k, s=shift: torch.topk(probs + s, k, dim=-1).indices
    return model


def engine_path(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence [T] through the engine's model: logprobs [T - 1] of tokens 1.., routed experts [T, L, k]."""
    with torch.no_grad():
        logits, _ = model(tokens[None], torch.arange(len(tokens))[None])
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, tokens[1:, None])[:, 0]
    routed = torch.stack([layer.mlp.routed[0] for layer in model.model.layers], dim=1)
    return logp, routed


@dataclasses.dataclass
class Padded:
    tokens: torch.Tensor
    routed_experts: torch.Tensor | None = None


@pytest.mark.unit
def test_replayed_routing_gives_the_engine_s_logprobs_where_its_router_chose_otherwise(moe_dir, moe_trainer):
    """The engine's choice differs from the trainer's router at some tokens: without replay the trainer's logprobs
    differ there (and after them), with megatron's RouterReplay fed the engine's experts they equal the engine's."""
    tokens = torch.randint(0, TINY_MOE.vocab_size, (40,), generator=torch.Generator().manual_seed(7))
    want, routed = engine_path(engine_with_shifted_routing(moe_dir), tokens)
    _, own = engine_path(load_llama(moe_dir), tokens)
    flipped = (routed.sort(-1).values != own.sort(-1).values).any(-1).any(-1)  # [T]: some layer chose otherwise
    assert 3 <= int(flipped.sum()) < len(tokens)
    with torch.no_grad():
        plain = moe_trainer.micro_batch_logprobs(Padded(tokens[None]))[0]
        replayed = moe_trainer.micro_batch_logprobs(Padded(tokens[None], routed[None]))[0]
    # logprob j is read at token j: a flip there changes it (and the later ones, which attend to token j)
    assert (plain - want)[flipped[:-1]].abs().max().item() > 1e-3
    assert (replayed - want).abs().max().item() < 1e-5


def replay_tree(moe_dir):
    """A tree of two branches from a shared prompt, with the shifted engine's logprobs and routed experts."""
    import numpy as np

    from gyre.traj.tree import CONTEXT, TrajectoryTree

    gen = torch.Generator().manual_seed(11)
    prefix, a, b = (torch.randint(0, TINY_MOE.vocab_size, (n,), generator=gen) for n in (9, 7, 6))
    engine = engine_with_shifted_routing(moe_dir)
    logp_a, routed_a = engine_path(engine, torch.cat([prefix, a]))
    logp_b, routed_b = engine_path(engine, torch.cat([prefix, b]))
    n, p = 9 + 7 + 6, 9
    parent = np.array([-1, *range(0, p + 6), p - 1, *range(p + 7, n - 1)], np.int32)
    depth = np.array([*range(p + 7), *range(p, p + 6)], np.int32)
    tokens = torch.cat([prefix, a, b]).numpy().astype(np.int32)
    engine_logprob = np.concatenate([[0.0], logp_a.numpy(), logp_b[p - 1 :].numpy()]).astype(np.float32)
    routed = torch.cat([routed_a, routed_b[p:]]).numpy().astype(np.int16)
    policy = np.arange(n) >= p
    call_id = np.where(policy, (np.arange(n) >= p + 7).astype(np.int64), CONTEXT)
    tree = TrajectoryTree("r", tokens, parent, depth, policy, np.where(policy, engine_logprob, 0), call_id,
                          np.zeros(n, np.uint8), routed_experts=routed)  # fmt: skip
    tree.validate()
    return tree, torch.from_numpy(engine_logprob)


@pytest.mark.unit
def test_replay_on_a_packed_and_a_split_tree_equals_the_engine_s_logprobs(moe_dir, moe_trainer):
    """Replay composed with tree training: the packed tree's logprobs are the engine's on each branch, and the tree
    trained in segments of 5 tokens gives the whole tree's logprobs and gradients."""
    from gyre.train.tree_pack import pack_forest, split_tree

    tree, engine_logprob = replay_tree(moe_dir)
    whole = pack_forest([tree])
    assert whole.routed_experts.shape == (tree.n_tokens, 2, 2)
    parts = split_tree(tree, 5)
    with torch.no_grad():
        logp = moe_trainer.micro_batch_logprobs(whole)
        split = moe_trainer.micro_batch_logprobs(parts)
    want = engine_logprob[whole.source_index]
    assert (logp - want)[whole.parent >= 0].abs().max().item() < 1e-5  # context and policy tokens alike
    torch.testing.assert_close(split, logp, rtol=0, atol=1e-6)
    grads = []
    for mb in (whole, parts):
        moe_trainer.zero_grad()
        moe_trainer.forward_backward([mb], lambda lp, m: (-(lp * m.loss_weight).sum(), {}))
        grads.append({n: p.grad.clone() for n, p in moe_trainer.model.named_parameters() if p.grad is not None})
    moe_trainer.zero_grad()
    assert grads[0].keys() == grads[1].keys() and any("router" in n for n in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.unit
def test_the_embedded_engine_returns_every_token_s_routed_experts(moe_dir):
    """`return_routed_experts` (SGLang's field and answer: base64 int32 of positions [0, prompt + output - 1)): the
    experts the engine's MoE layers chose for the prompt and each fed-back output token, also when the prompt's
    keys/values are in the prefix cache (such a request runs its whole prompt)."""
    import asyncio

    from gyre.engine.batcher import BatcherConfig
    from gyre.engine.client import EngineClient, SamplingParams
    from gyre.engine.server import EngineServer, running

    prompt = torch.randint(0, TINY_MOE.vocab_size, (12,), generator=torch.Generator().manual_seed(4)).tolist()

    async def generate() -> list:
        server = EngineServer(str(moe_dir), BatcherConfig(max_context_tokens=256))
        async with running(server) as url:
            client = EngineClient(url, timeout_s=60)
            try:
                sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
                return [await client.generate(prompt, sampling, routed_experts=True) for _ in range(2)]
            finally:
                await client.close()

    outs = asyncio.run(asyncio.wait_for(generate(), 60))
    seq = torch.tensor(prompt + outs[0].output_ids)
    _, want = engine_path(load_llama(moe_dir), seq)
    for out in outs:
        assert out.output_ids == outs[0].output_ids  # seeded
        got = torch.from_numpy(out.routed_experts.copy()).view(-1, 2, 2)
        assert torch.equal(got, want[:-1])  # the last output token was never fed back


@pytest.mark.unit
def test_routed_experts_round_trip_through_a_version_3_shard(moe_dir, tmp_path):
    """A tree's routed experts stored in /tokens/routed_experts (a version-3 shard; without them version 2) come back
    on the tree, and pack into the micro-batch the trainer replays."""
    import h5py

    from gyre.store.reader import read_shard
    from gyre.store.schema import RolloutMeta, ShardError
    from gyre.store.writer import write_shard
    from gyre.train.tree_pack import pack_forest

    tree, _ = replay_tree(moe_dir)
    meta = RolloutMeta("g", "t", "f", "builtin", "ok", 1.0, 1.0, 0.5)
    path = write_shard(tmp_path / "r.h5", [(tree, meta, tree.policy.astype("float32"))], run_id="r", step=0)
    shard = read_shard(path)
    assert shard.attrs["schema_version"] == 3
    back = shard.rollout(0).tree
    assert back.routed_experts.dtype == "int16" and (back.routed_experts == tree.routed_experts).all()
    assert torch.equal(pack_forest([back]).routed_experts, pack_forest([tree]).routed_experts)
    plain = dataclasses.replace(tree, routed_experts=None)
    other = write_shard(tmp_path / "p.h5", [(plain, meta, tree.policy.astype("float32"))], run_id="r", step=0)
    assert read_shard(other).attrs["schema_version"] == 2 and read_shard(other).rollout(0).tree.routed_experts is None
    with h5py.File(other, "r+") as f:
        f.attrs["schema_version"] = 3
    with pytest.raises(ShardError, match="schema_version 3 without /tokens/routed_experts"):
        read_shard(other)
    with h5py.File(path, "r+") as f:
        f["tokens/routed_experts"][0, 0, 0] += 1
    with pytest.raises(ShardError, match="routed_experts: checksum mismatch"):
        read_shard(path)


def routed_call(call_id: int, input_ids: list[int], output_ids: list[int], rows: np.ndarray):
    """A call record as the proxy keeps it with rl.routing_replay: its routed experts for input + output - 1."""
    from gyre.proxy.call_log import CallRecord, encode_routed_experts

    encoded, shape = encode_routed_experts(rows)
    return CallRecord("r", call_id, "chat", input_ids, output_ids, [-0.5] * len(output_ids), [], "stop", "0", "e",
                      len(input_ids), 0, 0.0, 1.0, routed_experts=encoded, routed_experts_shape=shape)  # fmt: skip


@pytest.mark.unit
def test_a_tree_takes_each_token_s_routed_experts_from_the_first_call_that_ran_it():
    """Two turns (the second's prompt is the first's prompt, output and a tool result) and a retry of the first turn
    that branches at its output: each token's experts are those of the first call whose engine ran the token (the
    record's JSON round trip included), -1 on a leaf's last token, and a sampled subtree keeps its tokens' rows."""
    from gyre.proxy.call_log import CallRecord
    from gyre.traj.build import build_tree
    from gyre.traj.sampling import subtree

    gen = np.random.default_rng(0)

    def rows(n: int) -> np.ndarray:
        return gen.integers(0, 4, (n, 2, 2)).astype(np.int16)

    first, second, retry = rows(4 + 3 - 1), rows(4 + 3 + 2 + 2 - 1), rows(4 + 2 - 1)
    calls = [routed_call(1, [1, 2, 3, 4], [5, 6, 7], first),
             routed_call(2, [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], second),
             routed_call(3, [1, 2, 3, 4], [12, 13], retry)]  # fmt: skip
    calls = [CallRecord.from_json(json.loads(json.dumps(c.to_json()))) for c in calls]
    tree = build_tree("r", calls)
    by_path = {tuple(tree.tokens[tree.path_to(i)].tolist()): i for i in range(tree.n_tokens)}
    node = [by_path[tuple(range(1, k + 1))] for k in range(1, 12)]  # tokens 1..11 along the two turns
    want = np.concatenate([first, second[len(first) :], np.full((1, 2, 2), -1, np.int16)])
    assert tree.routed_experts.dtype == np.int16 and np.array_equal(tree.routed_experts[node], want)
    retried = by_path[(1, 2, 3, 4, 12)], by_path[(1, 2, 3, 4, 12, 13)]
    assert np.array_equal(tree.routed_experts[retried[0]], retry[4]) and (tree.routed_experts[retried[1]] == -1).all()
    kept = np.sort(tree.path_to(retried[1]))
    assert np.array_equal(subtree(tree, kept).routed_experts, tree.routed_experts[kept])
    plain = [dataclasses.replace(c, routed_experts="", routed_experts_shape=[]) for c in calls]
    assert build_tree("r", plain).routed_experts is None  # rl.routing_replay off
