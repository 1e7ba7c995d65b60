"""Checks of config values that the types alone cannot express. Each error names the key, the value,
and what to change. Imports no torch/megatron/sglang.

Each field's own domain (a range, a choice) is declared beside it in the schema (gyre/config/domain.py) and
checked when a config is built, with the cross-field checks of its section (EngineConfig.__post_init__
calls check_engine). check_run is every check of the config across sections (the model against the engine's
and the trainer's layouts, since presets such as cluster=slurm_gpu are composed with whatever model a run
brings), run once at the edge, before anything starts (launch.run.check_before_start, which also checks a
model.path directory with gyre.model.pretrained.check_pretrained). Trainer and engine code never validate.
Imports nothing of gyre above the config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyre.config.domain import ConfigValueError as ConfigValueError  # where callers have always found it
from gyre.config.domain import check_fields
from gyre.config.domain import fail as _fail
from gyre.config.schema import HarnessKind, SandboxBackend, Scheduler, TaskSourceKind, resolved_weight_sync

if TYPE_CHECKING:
    from gyre.config.schema import (
        EngineConfig,
        HarnessConfig,
        MismatchConfig,
        ModelConfig,
        ProxyConfig,
        RLConfig,
        RunConfig,
        SandboxConfig,
        TaskConfig,
        TrainConfig,
    )


def check_sandbox(s: SandboxConfig) -> None:
    check_fields(s, "sandbox.")
    if s.backend == SandboxBackend.apptainer and not s.apptainer_image and not s.apptainer_images:
        _fail("sandbox.apptainer_image", s.apptainer_image,
              "backend=apptainer needs an image (a .sif file), or sandbox.apptainer_images per task image")  # fmt: skip


def check_tasks(t: TaskConfig, prefix: str = "tasks.") -> None:
    """`prefix`: where the group sits (`tasks.`, or `eval.tasks.` for an evaluation's own tasks)."""
    check_fields(t, prefix)
    if t.source != TaskSourceKind.builtin and not t.path:
        _fail(f"{prefix}path", t.path, f"{prefix}source={t.source} needs a path (a directory of tasks or a JSONL file)")
    if t.repos and t.source != TaskSourceKind.swebench:
        _fail(f"{prefix}repos", t.repos, f"repository snapshots are for {prefix}source=swebench only")


def check_task_sandbox(cfg: RunConfig) -> None:
    if cfg.tasks.source == TaskSourceKind.harbor and cfg.sandbox.backend == SandboxBackend.none:
        _fail("sandbox.backend", "none", "tasks.source=harbor: Harbor tests use /tests and /logs, which need an "
              "isolated sandbox (bwrap or apptainer)")  # fmt: skip


def check_eval(cfg: RunConfig) -> None:
    """Held-out builtin instances are drawn, so their number must be given; a suite's held-out split is
    the training suite's own."""
    e = cfg.eval
    builtin = (cfg.tasks if e.held_out else e.tasks).source == "builtin"
    if builtin and e.max_tasks == 0:
        _fail("eval.max_tasks", 0, "built-in tasks are drawn: say how many (0 means every task of a suite on disk)")
    if e.every and e.held_out and cfg.tasks.source != "builtin" and cfg.tasks.split != "train":
        _fail("eval.held_out", True, f"tasks.split={cfg.tasks.split} trains on the held-out split too; set "
              "tasks.split=train, or eval.held_out=false with eval.tasks")  # fmt: skip


def check_harness(h: HarnessConfig) -> None:
    check_fields(h, "harness.")
    if h.bare and h.kind not in HarnessKind.short_prompt_kinds():
        _fail("harness.bare", h.bare, "a short prompt exists for harness.kind=claude_code|mini_swe_agent|codex only")
    if h.kind != HarnessKind.builtin:
        for key in ("compact_tokens", "subagents", "reply_retries"):
            if getattr(h, key):
                _fail(f"harness.{key}", getattr(h, key),
                      f"the built-in harness's option; harness.kind={h.kind} compacts, delegates and retries by "
                      f"itself: leave it unset (choose a harness with harness=<kind>, not harness.kind=<kind>)")  # fmt: skip


def check_engine(e: EngineConfig) -> None:
    check_fields(e, "engine.")
    if e.backend == "embedded" and e.tp_size != 1:
        _fail("engine.tp_size", e.tp_size, "the embedded engine runs on one device; use engine.backend=sglang for TP")
    if e.backend == "embedded" and e.pp_size != 1:
        _fail("engine.pp_size", e.pp_size, "the embedded engine runs on one device; use engine.backend=sglang for PP")
    if e.pp_size > 1 and resolved_weight_sync(e) != "disk":
        _fail("engine.pp_size", e.pp_size,
              f"needs engine.weight_sync=disk (it resolves to {resolved_weight_sync(e)}): SGLang 0.5.23 ranks a "
              "weight-update group's engine ranks rank_offset + tp_rank (weight_updater.py), the same in every "
              "pipeline stage, and tensor updates go to TP ranks only")  # fmt: skip
    if e.hicache_storage_backend and not e.enable_hierarchical_cache:
        _fail("engine.hicache_storage_backend", e.hicache_storage_backend,
              "needs engine.enable_hierarchical_cache=true (SGLang's storage tier sits under HiCache)")  # fmt: skip
    if e.hicache_storage_extra_config:
        check_hicache_extra_config(e)
    if e.backend == "embedded" and e.weight_sync in ("tensor", "distributed"):
        _fail("engine.weight_sync", e.weight_sync, "the embedded engine loads weights from disk; use disk or auto")
    if e.backend == "embedded" and e.device != "cpu" and not e.device.startswith("cuda"):
        _fail("engine.device", e.device, "the embedded engine runs on 'cpu' or 'cuda[:N]'")


def check_hicache_extra_config(e: EngineConfig) -> None:
    """What SGLang would refuse at its start: extra config that is not a JSON object. A Mooncake store without
    its master's (or a client's) address (MooncakeStoreConfig.load_from_extra_config) gets the one the run
    starts (gyre.engine.hicache)."""
    import json

    key = "engine.hicache_storage_extra_config"
    try:
        extra = json.loads(e.hicache_storage_extra_config)
    except json.JSONDecodeError as err:
        _fail(key, e.hicache_storage_extra_config, f"is not JSON ({err})")
    if not isinstance(extra, dict):
        _fail(key, e.hicache_storage_extra_config, "must be a JSON object")
    # a Mooncake store without a master's (or a client's) address: the run starts mooncake_master and adds it


def check_rl(r: RLConfig) -> None:
    check_fields(r, "rl.")


def check_mismatch(m: MismatchConfig) -> None:
    """A correction compares the proximal policy with the engine's: with proximal=engine they are the same
    logprobs, the ratio is 1 everywhere and the correction would silently do nothing."""
    check_fields(m, "rl.mismatch.")
    if m.correction != "none" and m.proximal != "trainer":
        _fail("rl.mismatch.correction", str(m.correction),
              "corrects between the trainer's and the engine's logprobs: set rl.mismatch.proximal=trainer")  # fmt: skip


def check_engine_for_model(e: EngineConfig, m: ModelConfig) -> None:
    """SGLang shards attention heads over TP ranks: query heads must split evenly, and KV heads must
    either split evenly or be replicated (tp_size a multiple of them)."""
    if m.num_attention_heads % e.tp_size:
        _fail("engine.tp_size", e.tp_size,
              f"does not divide model.num_attention_heads={m.num_attention_heads}; pick a divisor of it")  # fmt: skip
    kv = m.num_query_groups
    if kv % e.tp_size and e.tp_size % kv:
        _fail("engine.tp_size", e.tp_size,
              f"neither divides nor is a multiple of model.num_query_groups={kv} (KV heads)")  # fmt: skip
    if e.pp_size > m.num_layers:
        _fail("engine.pp_size", e.pp_size, f"exceeds model.num_layers={m.num_layers}: a stage without a layer")
    if e.max_context_tokens > m.max_position_embeddings:
        _fail("engine.max_context_tokens", e.max_context_tokens,
              f"exceeds model.max_position_embeddings={m.max_position_embeddings}")  # fmt: skip


def check_model(m: ModelConfig) -> None:
    check_fields(m, "model.")
    if m.num_attention_heads % m.num_query_groups:
        _fail("model.num_query_groups", m.num_query_groups,
              f"must divide model.num_attention_heads={m.num_attention_heads}")  # fmt: skip
    if not m.head_dim and m.hidden_size % m.num_attention_heads:
        _fail("model.hidden_size", m.hidden_size,
              f"is not divisible by num_attention_heads={m.num_attention_heads}; set model.head_dim")  # fmt: skip
    if (m.head_dim or m.hidden_size // m.num_attention_heads) % 2:
        _fail("model.head_dim", m.head_dim, "RoPE needs an even head dimension")
    if m.num_experts and m.num_experts_per_tok > m.num_experts:
        _fail("model.num_experts_per_tok", m.num_experts_per_tok, f"exceeds model.num_experts={m.num_experts}")


def check_train(t: TrainConfig, m: ModelConfig) -> None:
    check_fields(t, "train.")
    if t.context_parallel > 1:  # every training micro-batch is a token tree (gyre/train/tree_pack.py)
        _fail("train.context_parallel", t.context_parallel,
              "Gyre trains on token trees (whole, or split into segments of train.micro_batch_tokens), which are "
              "not split over context-parallel ranks yet; set it to 1 (a tree over the budget is trained in "
              "segments instead, gyre/train/split_tree.py)")  # fmt: skip
    if m.num_attention_heads % t.tensor_parallel or m.num_query_groups % t.tensor_parallel:
        _fail("train.tensor_parallel", t.tensor_parallel,
              f"must divide model.num_attention_heads={m.num_attention_heads} and "
              f"model.num_query_groups={m.num_query_groups}")  # fmt: skip
    if m.vocab_size % t.tensor_parallel:
        _fail("train.tensor_parallel", t.tensor_parallel,
              f"must divide model.vocab_size={m.vocab_size} (the vocabulary is split over tensor-parallel ranks)")  # fmt: skip
    if m.tie_embeddings and t.pipeline_parallel > 1:
        _fail("train.pipeline_parallel", t.pipeline_parallel,
              "tied embeddings (model.tie_embeddings) across pipeline stages are not supported; set it to 1")  # fmt: skip
    if m.num_layers % t.pipeline_parallel:
        _fail("train.pipeline_parallel", t.pipeline_parallel, f"must divide model.num_layers={m.num_layers}")
    check_experts(t, m)


def check_experts(t: TrainConfig, m: ModelConfig) -> None:
    """What the trainer can honour of a mixture-of-experts model and train.expert_parallel."""
    if t.expert_parallel > 1 and not m.num_experts:
        _fail("train.expert_parallel", t.expert_parallel,
              "splits the experts of a mixture-of-experts model over ranks; this model is dense (model.num_experts=0): "
              "set it to 1")  # fmt: skip
    if not m.num_experts:
        return
    if m.num_experts % t.expert_parallel:
        _fail("train.expert_parallel", t.expert_parallel,
              f"must divide model.num_experts={m.num_experts} (each rank holds an equal share of the experts)")  # fmt: skip
    if t.tensor_parallel > 1:
        _fail("train.tensor_parallel", t.tensor_parallel,
              "the experts of a mixture-of-experts model are not split over tensor-parallel ranks yet: set it to 1 "
              "and split them with train.expert_parallel")  # fmt: skip
    if t.transformer_engine == "on":
        _fail("train.transformer_engine", "on",
              "a mixture-of-experts model trains with megatron's local spec (SequentialMLP experts); the Transformer "
              "Engine spec's grouped-GEMM expert weights are not converted to HF names yet: set it to off or auto")  # fmt: skip


def check_routing_replay(r: RLConfig, m: ModelConfig) -> None:
    """Routing replay needs routers: on a dense model it would replay nothing."""
    if r.routing_replay and not m.num_experts:
        _fail("rl.routing_replay", True,
              "replays the experts a mixture-of-experts model routed each token to; this model is dense "
              "(model.num_experts=0): set it to false")  # fmt: skip


def trainer_ranks(t: TrainConfig) -> int:
    """A cell's trainer world: its model-parallel layout; expert-parallel ranks train the same micro-batches."""
    return t.tensor_parallel * t.pipeline_parallel * t.context_parallel * t.expert_parallel


def cell_ranks(cfg: RunConfig) -> list[int]:
    """Ranks of each cell (core first): its nodes x tasks_per_node."""
    return [c.nodes * c.tasks_per_node for c in (cfg.cluster.core, *cfg.cluster.satellites)]


def check_cells(cfg: RunConfig) -> None:
    """What the cell runtime can honour: each cell one Megatron world of exactly its model-parallel layout
    (data parallel runs across cells, shard to shard), and its engines."""
    t = cfg.train
    model_parallel = trainer_ranks(t)
    for i, ranks in enumerate(cell_ranks(cfg)):
        key = "cluster.core" if i == 0 else f"cluster.satellites.{i - 1}"
        res = cfg.cluster.core if i == 0 else cfg.cluster.satellites[i - 1]
        if ranks != model_parallel:
            _fail(f"{key}.tasks_per_node", res.tasks_per_node,
                  f"cell {i} has {res.nodes} node(s) x {res.tasks_per_node} task(s) = {ranks} rank(s), but its trainer "
                  f"is train.tensor_parallel x pipeline_parallel x context_parallel x expert_parallel = {model_parallel} "
                  "rank(s): make "
                  "them equal (data parallelism runs across cells, not inside one)")  # fmt: skip
    if model_parallel > 1 and cfg.comm.transfer_backend == "gloo":
        _fail("comm.transfer_backend", "gloo",
              "cells of several ranks each run their own torch.distributed world, which the gloo transport (one "
              "world over the job) cannot share; use mooncake")  # fmt: skip
    check_engine_in_cells(cfg)


def check_engine_in_cells(cfg: RunConfig) -> None:
    """What a cell job can honour with SGLang engines: the controller routes to one engine URL per cell, so
    a cell holds one SGLang server (engine.tp_size x pp_size covers its GPUs, over several nodes if need be), and
    SGLang has no per-request KV export for rerouting with migration."""
    if cfg.engine.backend != "sglang":
        return
    if cfg.sched.kv_migration:
        _fail("sched.kv_migration", True, "SGLang engines have no per-request KV export; set sched.kv_migration=false")
    for i, cell in enumerate([cfg.cluster.core, *cfg.cluster.satellites]):
        gpus, span = cell.gpus_per_node * cell.nodes, cfg.engine.tp_size * cfg.engine.pp_size
        if cell.gpus_per_node and gpus != span:
            _fail("engine.tp_size", cfg.engine.tp_size,
                  f"with engine.pp_size={cfg.engine.pp_size} holds {span} GPUs, but cell {i} has {cell.nodes} node(s) "
                  f"of {cell.gpus_per_node} GPUs: one SGLang server per cell must span them all (tp_size x pp_size = "
                  f"{gpus}); the controller routes to one engine per cell")  # fmt: skip
        if cell.gpus_per_node:
            check_weight_sync_on_gpus(cfg.engine, i, cell.nodes)


def check_weight_sync_on_gpus(e: EngineConfig, cell: int, nodes: int) -> None:
    """A cell's SGLang server runs on the GPUs its trainer ranks use (released while they train): NCCL refuses
    a communicator with two ranks on one GPU, and CUDA IPC handles open only on their own node."""
    sync = resolved_weight_sync(e)
    if sync == "distributed":
        _fail("engine.weight_sync", e.weight_sync,
              "resolves to distributed, a broadcast group of trainer and engine ranks over NCCL, which refuses two "
              "ranks on one GPU ('Duplicate GPU detected') and the cell's server shares its trainer's GPUs; use "
              "tensor (CUDA IPC, a server within one node) or disk (docs/gpu.md)")  # fmt: skip
    if sync == "tensor" and nodes > 1:
        _fail("engine.weight_sync", e.weight_sync,
              f"CUDA IPC handles open only on the node that made them, and cell {cell}'s server spans {nodes} "
              "nodes; use disk (docs/gpu.md)")  # fmt: skip


def check_proxy(p: ProxyConfig) -> None:
    check_fields(p, "proxy.")


def check_run(cfg: RunConfig) -> None:
    """Every config check, for a run about to start its engines and trainer with this model: what launch.run
    calls before anything starts (every field in its domain, then the checks across fields and sections)."""
    check_fields(cfg)
    check_engine(cfg.engine)
    check_rl(cfg.rl)
    check_sandbox(cfg.sandbox)
    check_task_sandbox(cfg)
    if not cfg.model.path:  # else the directory's config.json is the architecture: gyre.model.pretrained checks it
        check_model(cfg.model)
        check_engine_for_model(cfg.engine, cfg.model)
        check_train(cfg.train, cfg.model)
        check_routing_replay(cfg.rl, cfg.model)
    if Scheduler(cfg.scheduler).runs_cells:
        check_cells(cfg)
