"""Typed configuration tree. Each component owns one dataclass; YAML in conf/ only sets values.

This module must import without torch, megatron, sglang or mooncake (tests check sys.modules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


@dataclass
class ModelConfig:
    """A Llama/Qwen-style decoder: RoPE, RMSNorm, SwiGLU, grouped-query attention."""

    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 4
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 352
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init: str = "torch"  # torch: PyTorch module defaults (learns copying far sooner); megatron: N(0, init_std)
    init_std: float = 0.02
    tie_embeddings: bool = False
    seed: int = 1234
    head_dim: int = 0  # 0: hidden_size // heads; Qwen3 decouples it (0.6B: hidden 1024, 16 heads of 128)
    qk_layernorm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE (HF q_norm/k_norm)
    # a local HF-format Qwen3/Qwen2/Llama directory to start from (gyre/model/pretrained.py): its config.json
    # replaces the architecture keys above, its tokenizer the trained one; no warm start
    path: str = ""
    # with model.path: "directory" checks that the directory's chat template renders as gyre's proxy does (the
    # proxy renders gyre/model/chat_template.py's, token in / token out); "gyre" accepts that it differs
    chat_template: str = "directory"


@dataclass
class TokenizerConfig:
    vocab_size: int = 1024
    corpus_tasks: int = 2000


@dataclass
class EngineConfig:
    backend: str = "embedded"
    host: str = "127.0.0.1"
    port: int = 0
    max_running_requests: int = 64
    max_context_tokens: int = 4096
    num_threads: int = 1
    startup_timeout_s: float = 120.0
    tp_size: int = 1  # sglang: tensor-parallel GPUs per server
    mem_fraction_static: float = 0.85  # sglang: GPU memory share for weights + KV cache
    device: str = "cpu"  # embedded: torch device of the model and KV cache ("cuda" on a GPU machine)
    dtype: str = "auto"  # auto: fp32 for the embedded engine, SGLang's choice (bf16) for sglang
    # how new weights reach the engine: disk (a checkpoint), tensor (same node, SGLang), distributed (a
    # broadcast group with the trainer, SGLang); auto: disk for embedded, distributed for sglang
    weight_sync: str = "auto"
    # backend=sglang only; each maps to the sglang.launch_server flag of the same name (server_args.py)
    python: str = "python"  # interpreter with sglang installed on the engine's node
    load_format: str = "auto"  # "dummy": random weights, nothing read from the checkpoint
    enable_memory_saver: bool = True  # needed for /release_memory_occupation on role switches
    enable_weights_cpu_backup: bool = False  # release keeps a CPU copy of the weights (resume without a sync)
    chunked_prefill_size: int = 0  # 0: SGLang's default
    disable_radix_cache: bool = False
    enable_hierarchical_cache: bool = False  # host-memory KV tier (HiCache)
    hicache_storage_backend: str = ""  # e.g. "mooncake": KV prefixes in a store other engines read
    base_gpu_id: int = 0
    random_seed: int = 0
    log_level: str = "info"
    extra_args: list[str] = field(default_factory=list)  # more launch_server flags, passed verbatim

    def __post_init__(self) -> None:
        from gyre.config.validate import check_engine

        check_engine(self)


@dataclass
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 0
    max_context_tokens: int = 4096
    default_max_tokens: int = 96
    max_output_tokens: int | None = None  # caps every call's max_tokens (harnesses ask for 32000+)
    request_timeout_s: float = 300.0
    # a session's next call goes to the engine of its last call (its prefix is cached there) unless that engine
    # has this many more requests in flight than the least-loaded one; -1: least-loaded only
    affinity_slack: int = 2
    # what bad input or load can take: request bodies over max_body_mb are refused (413; a 1M-token conversation
    # is ~5 MB of JSON); a body must arrive within body_timeout_s; a connection without a request (or with only
    # part of its headers) for idle_timeout_s is closed; connections over max_connections are answered 503
    max_body_mb: int = 32
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 75.0
    max_connections: int = 1024
    # per rollout (its key, or its path/header id without keys): calls in flight beyond max_rollout_requests get
    # 429, connections beyond max_rollout_connections close that rollout's idle ones first, then get 429; when
    # max_connections is reached, an idle connection (one that never sent a request first) is closed for the new one
    max_rollout_requests: int = 32
    max_rollout_connections: int = 64
    # every request's work before the engine (validation, rendering, tokenizing) runs on this many threads, off
    # the event loop, one rollout holding half of them at most; the token cache of prompt segments holds at most
    # token_cache_mb
    prepare_threads: int = 4
    token_cache_mb: int = 256
    # a body of 512 KB or more is measured in a helper process before it is parsed: over this many JSON values
    # (parsing holds the event loop ~0.3 us per value) it gets 413
    max_body_values: int = 250_000

    def __post_init__(self) -> None:
        from gyre.config.validate import check_proxy

        check_proxy(self)


@dataclass
class TaskConfig:
    """Where tasks come from (gyre/tasks/source.py): builtin families, or a suite on disk at `path`."""

    source: str = "builtin"  # builtin | harbor (a directory of task dirs) | swebench (a JSONL file)
    path: str = ""  # harbor: directory of tasks (or one task); swebench: instances JSONL; relative: to the cwd
    repos: str = ""  # swebench: directory of repository snapshots (owner__name); empty: <path's dir>/repos
    split: str = "train"  # train | eval (held out) | all: which instances of a suite on disk the run uses
    eval_fraction: float = 0.25  # share of a suite's instances held out for eval (by a hash of the instance id)
    families: list[str] = field(default_factory=lambda: ["write_value"])
    # the RL training set: this many instances (families in equal shares, or a seeded sample of the split),
    # revisited in shuffled epochs; 0 = fresh instances every step (builtin) or the whole split (suites on disk)
    pool_size: int = 8
    check_timeout_s: float = 10.0
    tool_delay_s: float = 0.0
    # every tool call of the built-in harness takes this long on average (builds, tests): a long-tailed
    # workload. Each rollout draws a factor ~ lognormal(mean 1, sigma tool_time_sigma) from its rollout id
    tool_time_s: float = 0.0
    tool_time_sigma: float = 1.0

    def __post_init__(self) -> None:
        from gyre.config.validate import check_tasks

        check_tasks(self)


@dataclass
class HarnessConfig:
    """The agent program each rollout runs (gyre/harness); presets: `harness=builtin|claude_code|mini_swe_agent`."""

    kind: str = "builtin"  # builtin | claude_code | mini_swe_agent
    max_turns: int = 10
    timeout_s: float = 90.0
    temperature: float = 1.0  # builtin and mini_swe_agent; Claude Code sends its own
    max_tokens: int = 64  # builtin and mini_swe_agent; Claude Code asks for 64000 (cap it: proxy.max_output_tokens)
    concurrency: int = 16
    keep_workspaces: bool = False
    # the short prompt: claude_code `claude --bare` (a one-line system prompt, tools Bash/Edit/Read: ~300 tokens);
    # mini_swe_agent compact system/instance templates (gyre/harness/mini_swe_agent.py: a first request of ~80 tokens, not ~850)
    bare: bool = False

    def __post_init__(self) -> None:
        from gyre.config.validate import check_harness

        check_harness(self)


class LogprobDistribution(StrEnum):
    """Which distribution behaviour and training logprobs describe (both: logits / the call's temperature)."""

    tempered = "tempered"  # softmax(logits / T) over the whole vocabulary; top-k/top-p/min-p truncation ignored
    truncated = "truncated"  # the same, renormalised over the tokens top-k/top-p/min-p kept: what was sampled


@dataclass
class SandboxConfig:
    """Where harnesses and checkers run (gyre/sandbox). bwrap: bubblewrap namespaces, only the workspace
    writable, no network but the rollout's own proxy endpoint; apptainer: the same on clusters, in
    `apptainer_image`; none: the trainer's own user, files, network and environment (asked for only,
    recorded in every shard's provenance)."""

    backend: str = "bwrap"  # bwrap | apptainer | none
    apptainer_image: str = ""  # backend=apptainer: the image (.sif) harnesses and checkers run in
    # backend=apptainer: a task's environment image (Harbor's docker_image, a SWE-bench instance's image) -> .sif;
    # once given, a task whose image is not here fails; tasks naming no image use apptainer_image
    apptainer_images: dict[str, str] = field(default_factory=dict)
    file_size_mb: int = 256  # RLIMIT_FSIZE: largest file a sandboxed process may write
    open_files: int = 1024  # RLIMIT_NOFILE
    # RLIMIT_NPROC; the kernel counts every process of the real user (machine-wide), so leave headroom
    processes: int = 4096
    env: list[str] = field(default_factory=list)  # host environment variables passed in besides the allowlist

    def __post_init__(self) -> None:
        from gyre.config.validate import check_sandbox

        check_sandbox(self)


@dataclass
class RLConfig:
    algorithm: str = "gspo"
    group_size: int = 8  # 4 leaves a hard task's group all-fail too often: no advantage, nothing learned
    groups_per_step: int = 8  # with tasks.pool_size 8: every step visits the whole training set once
    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    max_trajectories_per_rollout: int = 5
    logprob_distribution: LogprobDistribution = LogprobDistribution.tempered
    # the step's loss is averaged over: all_rollouts (every rollout that entered the objective, zero advantage
    # included: the GSPO paper's and TRL's choice) or with_signal (only rollouts with a non-zero advantage)
    loss_norm: str = "all_rollouts"
    # a step with every rollout excluded (an infrastructure failure: nothing scored, nothing trained), or more
    # than this fraction of them, counts as failed; max_excluded_steps failed steps in a row stop the run with
    # the exclusion reasons counted (0: never stop)
    max_excluded_fraction: float = 0.5
    max_excluded_steps: int = 1

    def __post_init__(self) -> None:
        from gyre.config.validate import check_rl

        check_rl(self)


@dataclass
class TrainConfig:
    backend: str = "megatron"
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096
    num_threads: int = 1  # on 2 shared cores one thread beats two (measured 5x)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1  # CUDA only, like tensor/pipeline parallel > 1 (torchrun or srun world)
    # on: megatron's Transformer Engine layer spec (CUDA; padded micro-batches only, tree plans need the local
    # spec); auto: on when CUDA and transformer_engine are importable; off: local spec everywhere
    transformer_engine: str = "off"
    distributed_optimizer: bool = True  # CUDA: megatron's DDP + distributed optimizer; CPU: torch AdamW


@dataclass
class WarmStartConfig:
    enabled: bool = True
    # short on purpose: the policy starts able but unreliable (about half of its rollouts succeed), which
    # leaves RL something to show on the embedded default
    steps: int = 200
    lr: float = 2e-3
    batch_size: int = 16
    pack_tokens: int = 384
    demos: int = 2000
    families: list[str] = field(default_factory=list)  # demonstrations' families; empty: tasks.families
    cache_dir: str = "${oc.env:GYRE_CACHE,${oc.env:HOME}/.cache/gyre}"


@dataclass
class CellResources:
    """One cell's share of a Slurm allocation: one component of the heterogeneous job."""

    nodes: int = 1
    # ranks of the cell on each node; the cell's trainer world is nodes x tasks_per_node ranks, one Megatron
    # layout of train.tensor_parallel x pipeline_parallel (rank 0 of the cell leads: engine, control plane)
    tasks_per_node: int = 1
    cpus_per_node: int = 1
    gpus_per_node: int = 0
    mem: str = ""  # per node, Slurm syntax ("64G"); empty: the partition's default
    partition: str = "debug"
    time: str = "01:00:00"


@dataclass
class MooncakeConfig:
    """The cluster fabric as Mooncake Transfer Engine sees it (weights and KV between cells)."""

    protocol: str = "tcp"  # tcp | rdma
    device_name: str = ""  # RDMA NICs, e.g. "mlx5_0,mlx5_1"; empty: let Mooncake choose
    metadata_server: str = "P2PHANDSHAKE"


@dataclass
class ClusterConfig:
    """Where cells run. slurm: one heterogeneous job, component 0 the core cell, 1..N the satellites."""

    backend: str = "local"  # local: processes on this machine; slurm: launch/submit.py
    job_name: str = "gyre"
    account: str = ""
    qos: str = ""
    mpi: str = ""  # srun --mpi for the cell job's step (pmix, pmi2); empty: the cluster's MpiDefault
    # interpreter on the compute nodes; empty: the submitting interpreter by absolute path (a filesystem shared by
    # the nodes). A bare name ("python") needs a setup line that puts the run's environment first on the PATH
    python: str = ""
    # sbatch --export: ALL passes the submitting shell's environment on (SLURM_CONF, HOME, a venv's PATH); NONE
    # starts the job without it (then cluster.setup must provide HOME/GYRE_CACHE and the environment)
    export: str = "ALL"
    workdir: str = ""  # where steps run; empty: the directory the job is submitted from
    setup: list[str] = field(default_factory=list)  # shell lines before the steps (module load, venv)
    log_dir: str = ""  # empty: <output_dir>/slurm
    requeue: bool = True  # sbatch --requeue: preemption and `scontrol requeue` put the job back in the queue
    # sbatch --signal=B:TERM@<this>: SIGTERM this long before the time limit; the run checkpoints, exits 75 and
    # the script requeues it (0: no signal). Also what a stop may take: finishing an update + a checkpoint write
    preempt_grace_s: int = 120
    # the cell job's start: rank 0 marks the MPI world up once every rank is past MPI_Init; a start that
    # fails or hangs before that (PMI-2 start-ups do, now and then, on a loaded machine) is ended and run again
    mpi_start_timeout_s: int = 120
    mpi_start_attempts: int = 3
    core: CellResources = field(default_factory=CellResources)
    satellites: list[CellResources] = field(default_factory=lambda: [CellResources(), CellResources()])
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)


@dataclass
class CommConfig:
    """The control plane and weight/KV transfer between cells (gyre/comm); Mooncake's fabric is
    `cluster.mooncake`."""

    transfer_backend: str = "mooncake"  # mooncake | gloo (torch.distributed fallback)
    # the address peers reach this rank at (its engine, Mooncake, gloo), resolved once on the rank's node:
    # "auto": this node's host name resolved there (a loopback answer is refused once the job spans hosts)
    hostname: str = "127.0.0.1"
    interface: str = ""  # with hostname=auto: the address of this network interface instead (eth0, ib0)
    idle_poll_max_s: float = 0.02  # longest sleep between control-plane probes while idle


@dataclass
class SchedConfig:
    """Cells under one MPI job (scheduler=elastic|async|colocate_cells): rank 0 the controller, ranks
    1..C the cells (C = 1 + len(cluster.satellites)), cell 1 the core (gyre/sched)."""

    capacity_per_cell: int = 8  # concurrent rollout sessions one rollout cell serves (its KV budget)
    staleness: int = 1  # async/elastic: rollouts of step s may start once weights of version s - staleness exist
    async_rollout_cells: int = 0  # async: cells fixed to rollout (0: every satellite; the core trains)
    micro_batches_in_flight: int = 1  # per training cell; more hides the controller round trip
    kv_migration: bool = True  # move in-flight requests' keys/values with them when a cell leaves rollout
    # CPU set of each rank ("0-1", "0,2"), controller first; empty: controller on all CPUs, cell i on CPU (i-1) mod n
    cpu_sets: list[str] = field(default_factory=list)
    threads_per_cell: int = 1  # torch threads of each cell's trainer and engine
    cell_timeout_s: float = 120.0  # a cell that answers nothing for this long is declared dead
    # a run that lost cells (rank gone, silent, or an engine unreachable or failing every call) finishes without
    # them and lists them in summary.json's dead_cells; it exits non-zero (DEAD_CELLS_EXIT_CODE) unless this is set
    allow_dead_cells: bool = False
    mpirun: str = ""  # empty: the mpirun next to this Python (MPICH from PyPI)
    faults: list[str] = field(default_factory=list)  # injected faults, e.g. "kill_cell:3:after_micro_batches:1"


@dataclass
class TrackingConfig:
    """Where `logger=tensorboard|wandb` sends the run (metrics.jsonl is always written: the source of truth)."""

    run_name: str = ""  # empty: the Hydra job's overrides (one run per multirun job), else the output dir's name
    wandb_project: str = "gyre"
    wandb_mode: str = "offline"  # offline: compute nodes often have no internet; `wandb sync <run dir>` later

    def __post_init__(self) -> None:
        if self.wandb_mode not in ("offline", "online", "disabled"):
            from gyre.config.validate import ConfigValueError

            raise ConfigValueError(f"tracking.wandb_mode={self.wandb_mode!r}: choose offline, online or disabled")


@dataclass
class RunConfig:
    steps: int = 24
    seed: int = 0
    scheduler: str = "colocate"
    output_dir: str = ""  # empty: Hydra's run directory (outputs/<date>_<time>)
    checkpoint_every: int = 4
    # auto: continue from output_dir/checkpoint/ when it is complete, else start at step 0; must: continue or
    # fail; never: start at step 0, moving an earlier run's outputs aside (gyre/resume/recovery.py)
    resume: str = "auto"
    # experiment trackers beside metrics.jsonl: jsonl, tensorboard, wandb; several at once: logger=[tensorboard,wandb]
    logger: list[str] = field(default_factory=lambda: ["jsonl"])
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    tasks: TaskConfig = field(default_factory=TaskConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)

    def __post_init__(self) -> None:
        from gyre.config.validate import check_loggers, check_task_sandbox

        check_loggers(self.logger)
        check_task_sandbox(self)
