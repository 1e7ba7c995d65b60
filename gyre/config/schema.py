"""Typed configuration tree. Each component owns one dataclass; YAML in conf/ only sets values.

This module must import without torch, megatron, sglang or mooncake (tests check sys.modules).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from gyre.config.domain import (
    AT_LEAST_1,
    NON_NEGATIVE,
    PORT,
    POSITIVE,
    SEED,
    UNIT_INTERVAL,
    Range,
    check_fields,
    choice,
    ranged,
)

# The choices of string fields, each declared once as an enum; a field's domain is declared beside it from its
# enum (`choice(Scheduler.colocate, Scheduler)`), and code compares against the members, never a string literal.
# The fields stay `str` for Hydra (a StrEnum member equals its value), so an unknown value is refused by
# gyre.config.domain with the allowed ones named, like every other out-of-domain value.


class ModelInit(StrEnum):
    torch = "torch"
    megatron = "megatron"


class ChatTemplate(StrEnum):
    directory = "directory"
    gyre = "gyre"


class EngineBackend(StrEnum):
    embedded = "embedded"
    sglang = "sglang"


class EngineDtype(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class SGLangLoadFormat(StrEnum):
    """SGLang's --load-format choices that read an HF-format directory or none (server_args.py has more)."""

    auto = "auto"
    safetensors = "safetensors"
    pt = "pt"
    dummy = "dummy"
    fastsafetensors = "fastsafetensors"
    layered = "layered"


class WeightSync(StrEnum):
    auto = "auto"
    disk = "disk"
    tensor = "tensor"
    distributed = "distributed"


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"
    critical = "critical"


class TaskSourceKind(StrEnum):
    """Where tasks come from (gyre/tasks/source.py)."""

    builtin = "builtin"
    harbor = "harbor"
    swebench = "swebench"


class TaskSplit(StrEnum):
    train = "train"
    eval = "eval"
    all = "all"


class HarnessKind(StrEnum):
    """The agent program a rollout runs; each kind's command, environment, trace, demos and preflight are one
    object in gyre/harness/kinds.py."""

    builtin = "builtin"
    claude_code = "claude_code"
    mini_swe_agent = "mini_swe_agent"
    codex = "codex"

    @staticmethod
    def short_prompt_kinds() -> tuple[str, ...]:
        """Kinds with a short prompt (harness.bare): Claude Code's --bare, mini-swe-agent's compact templates,
        Codex's one-line instructions."""
        return (HarnessKind.claude_code, HarnessKind.mini_swe_agent, HarnessKind.codex)


class SandboxBackend(StrEnum):
    bwrap = "bwrap"
    apptainer = "apptainer"
    none = "none"


class RLAlgorithm(StrEnum):
    gspo = "gspo"


class LossNorm(StrEnum):
    all_rollouts = "all_rollouts"
    with_signal = "with_signal"


class TrainBackend(StrEnum):
    """The trainer gyre.train.trainer.make_trainer builds."""

    megatron = "megatron"


class TransformerEngine(StrEnum):
    auto = "auto"
    on = "on"
    off = "off"


class MooncakeProtocol(StrEnum):
    tcp = "tcp"
    rdma = "rdma"


class ClusterBackend(StrEnum):
    local = "local"
    slurm = "slurm"


class TransferBackend(StrEnum):
    mooncake = "mooncake"
    gloo = "gloo"


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


class Scheduler(StrEnum):
    """colocate: the core cell alternates, in the controller's process (gyre/sched/launch/in_process.py); the others run
    cells as an MPI job (gyre/sched); one controller runs them all (gyre/sched/controller/orchestrator.py)."""

    colocate = "colocate"
    colocate_cells = "colocate_cells"
    async_ = "async"
    elastic = "elastic"

    @property
    def runs_cells(self) -> bool:
        return self is not Scheduler.colocate


CELL_SCHEDULERS = tuple(s for s in Scheduler if s.runs_cells)


class Admission(StrEnum):
    """gyre/sched/policy/admission.py"""

    group_length = "group_length"
    fifo = "fifo"


class ResumeMode(StrEnum):
    """gyre/resume/recovery.py"""

    auto = "auto"
    never = "never"
    must = "must"


class Logger(StrEnum):
    jsonl = "jsonl"
    tensorboard = "tensorboard"
    wandb = "wandb"


@dataclass
class ModelConfig:
    """A Llama/Qwen-style decoder: RoPE, RMSNorm, SwiGLU, grouped-query attention."""

    vocab_size: int = ranged(1024, AT_LEAST_1)  # vocabulary of the built model (the tokenizer's size or more)
    hidden_size: int = ranged(128, AT_LEAST_1)  # width of the decoder
    num_layers: int = ranged(4, AT_LEAST_1)  # decoder layers
    num_attention_heads: int = ranged(4, AT_LEAST_1)  # query heads
    num_query_groups: int = ranged(2, AT_LEAST_1)  # key/value heads (grouped-query attention)
    ffn_hidden_size: int = ranged(352, AT_LEAST_1)  # SwiGLU inner width
    # longest sequence (RoPE positions); a tree longer is trained in segments
    max_position_embeddings: int = ranged(4096, AT_LEAST_1)
    rope_theta: float = ranged(10000.0, POSITIVE)  # RoPE base
    norm_eps: float = ranged(1e-6, POSITIVE)  # RMSNorm epsilon
    # torch: PyTorch module defaults (learns copying far sooner); megatron: N(0, init_std)
    init: str = choice(ModelInit.torch, ModelInit)
    init_std: float = ranged(0.02, POSITIVE)  # std of init=megatron
    tie_embeddings: bool = False  # share input embeddings and output layer
    seed: int = ranged(1234, SEED)  # seed of the initial weights
    # 0: hidden_size // heads; Qwen3 decouples it (0.6B: hidden 1024, 16 heads of 128)
    head_dim: int = ranged(0, NON_NEGATIVE, why="0: hidden_size // num_attention_heads")
    qk_layernorm: bool = False  # Qwen3: RMSNorm over each query and key head before RoPE (HF q_norm/k_norm)
    # Qwen3-MoE (gyre/model/llama.py SparseMoE, megatron's MoE layer): experts per MoE layer; 0: a dense model
    num_experts: int = ranged(0, NON_NEGATIVE, why="0: dense")
    num_experts_per_tok: int = ranged(2, AT_LEAST_1)  # top-k experts each token is routed to
    moe_ffn_hidden_size: int = ranged(0, NON_NEGATIVE, why="0: ffn_hidden_size")  # each expert's SwiGLU width
    norm_topk_prob: bool = True  # the top-k softmax probabilities renormalised to sum to one (Qwen3-MoE: true)
    decoder_sparse_step: int = ranged(1, AT_LEAST_1)  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here (those are dense)
    # the load-balancing loss's weight in training (HF: router_aux_loss_coef, applied with output_router_logits)
    router_aux_loss_coef: float = ranged(0.0, NON_NEGATIVE, why="0: no auxiliary loss")
    # a local HF-format Qwen3/Qwen3-MoE/Qwen2/Llama directory to start from (gyre/model/pretrained.py): its config.json
    # replaces the architecture keys above, its tokenizer the trained one; no warm start
    path: str = ""
    # with model.path: "directory" checks that the directory's chat template renders as gyre's proxy does (the
    # proxy renders gyre/model/chat_template.py's, token in / token out); "gyre" accepts that it differs
    chat_template: str = choice(ChatTemplate.directory, ChatTemplate)


@dataclass
class TokenizerConfig:
    vocab_size: int = ranged(1024, AT_LEAST_1)  # BPE tokens trained for the built-in model (model.path brings its own)
    corpus_tasks: int = ranged(2000, AT_LEAST_1)  # demonstrations the BPE is trained on


@dataclass
class EngineConfig:
    # embedded: Gyre's CPU engine; sglang: SGLang servers (GPU)
    backend: str = choice(EngineBackend.embedded, EngineBackend, "engine backend")
    host: str = "127.0.0.1"  # address the engine listens on
    port: int = ranged(0, PORT)  # its port; 0: a free one
    max_running_requests: int = ranged(64, AT_LEAST_1)  # requests decoded together (continuous batching)
    # prompt + output tokens one request may hold
    max_context_tokens: int = ranged(4096, Range(low=2), why="a prompt token and an output token")
    num_threads: int = ranged(1, AT_LEAST_1)  # torch threads of the embedded engine
    startup_timeout_s: float = ranged(120.0, POSITIVE)  # how long the engine may take to answer /health
    tp_size: int = ranged(1, AT_LEAST_1)  # sglang: tensor-parallel GPUs per server
    # sglang: pipeline stages per server (--pp-size); a server holds tp_size x pp_size GPUs. Above 1 needs
    # weight_sync=disk: SGLang's weight-update groups rank engine ranks by TP rank only
    pp_size: int = ranged(1, AT_LEAST_1)
    # sglang: GPU memory share for weights + KV cache
    mem_fraction_static: float = ranged(0.85, Range(0, 1, low_open=True, high_open=True), why="e.g. 0.8")
    device: str = "cpu"  # embedded: torch device of the model and KV cache ("cuda" on a GPU machine)
    dtype: str = choice(
        EngineDtype.auto, EngineDtype
    )  # auto: fp32 for the embedded engine, SGLang's choice (bf16) for sglang
    # how new weights reach the engine: disk (a checkpoint), tensor (same node, SGLang), distributed (a
    # broadcast group with the trainer, SGLang); auto: disk for embedded, distributed for sglang
    weight_sync: str = choice(WeightSync.auto, WeightSync)
    # backend=sglang only; each maps to the sglang.launch_server flag of the same name (server_args.py)
    python: str = "python"  # interpreter with sglang installed on the engine's node
    load_format: str = choice(
        SGLangLoadFormat.auto, SGLangLoadFormat
    )  # "dummy": random weights, nothing read from the checkpoint
    enable_memory_saver: bool = True  # needed for /release_memory_occupation on role switches
    enable_weights_cpu_backup: bool = False  # release keeps a CPU copy of the weights (resume without a sync)
    # 0: SGLang's default
    chunked_prefill_size: int = ranged(0, Range(low=-1), why="0: SGLang's default; -1: no chunking")
    disable_radix_cache: bool = False  # sglang: --disable-radix-cache
    enable_hierarchical_cache: bool = False  # host-memory KV tier (HiCache)
    hicache_storage_backend: str = ""  # e.g. "mooncake": KV prefixes in a store other engines read
    # sglang HiCache: when computed KV pages go to host memory, and from there to the storage backend
    hicache_write_policy: str = choice("write_through", ("write_back", "write_through", "write_through_selective"))
    # sglang: when prefetching a prefix found in the storage backend stops (the rest is prefilled)
    hicache_storage_prefetch_policy: str = choice("timeout", ("best_effort", "wait_complete", "timeout"))
    # sglang: --hicache-storage-backend-extra-config, a JSON object; mooncake without "master_server_address": the run starts one
    hicache_storage_extra_config: str = ""
    base_gpu_id: int = ranged(0, NON_NEGATIVE)  # sglang: first GPU of the server
    random_seed: int = ranged(0, SEED)  # sglang: --random-seed
    log_level: str = choice(LogLevel.info, LogLevel)  # sglang: --log-level
    extra_args: list[str] = field(default_factory=list)  # more launch_server flags, passed verbatim

    def __post_init__(self) -> None:
        from gyre.config.validate import check_engine

        check_engine(self)


def resolved_weight_sync(cfg: EngineConfig) -> str:
    """engine.weight_sync with "auto" resolved: disk for the embedded engine, distributed for SGLang."""
    if cfg.weight_sync != "auto":
        return cfg.weight_sync
    return "disk" if cfg.backend == "embedded" else "distributed"


@dataclass
class ProxyConfig:
    host: str = "127.0.0.1"  # address the proxy listens on
    port: int = ranged(0, PORT)  # its port; 0: a free one
    # context limit (OpenAI context_length_exceeded, Anthropic 'prompt is too long')
    max_context_tokens: int = ranged(4096, AT_LEAST_1)
    default_max_tokens: int = ranged(96, AT_LEAST_1)  # output tokens of a call that asks for none
    # caps every call's max_tokens (harnesses ask for 32000+)
    max_output_tokens: int | None = ranged(None, AT_LEAST_1, why="or null: no cap")
    request_timeout_s: float = ranged(300.0, POSITIVE)  # longest a call may wait for its engine
    # a session's next call goes to the engine of its last call (its prefix is cached there) unless that engine
    # has this many more requests in flight than the least-loaded one; -1: least-loaded only
    affinity_slack: int = ranged(2, Range(low=-1), why="-1: least-loaded only")
    # what bad input or load can take: request bodies over max_body_mb are refused (413; a 1M-token conversation
    # is ~5 MB of JSON); a body must arrive within body_timeout_s; a connection without a request (or with only
    # part of its headers) for idle_timeout_s is closed; connections over max_connections are answered 503
    max_body_mb: int = ranged(32, POSITIVE)
    body_timeout_s: float = ranged(60.0, POSITIVE)  # see proxy.max_body_mb
    idle_timeout_s: float = ranged(75.0, POSITIVE)  # see proxy.max_body_mb
    max_connections: int = ranged(1024, POSITIVE)  # see proxy.max_body_mb
    # per rollout (its key, or its path/header id without keys): calls in flight beyond max_rollout_requests get
    # 429, connections beyond max_rollout_connections close that rollout's idle ones first, then get 429; when
    # max_connections is reached, an idle connection (one that never sent a request first) is closed for the new one
    max_rollout_requests: int = ranged(32, POSITIVE)
    max_rollout_connections: int = ranged(64, POSITIVE)  # see proxy.max_rollout_requests
    # every request's work before the engine (validation, rendering, tokenizing) runs on this many threads, off
    # the event loop, one rollout holding half of them at most; the token cache of prompt segments holds at most
    # token_cache_mb
    prepare_threads: int = ranged(4, POSITIVE)
    token_cache_mb: int = ranged(256, POSITIVE)  # see proxy.prepare_threads
    # a body of 512 KB or more is measured in a helper process before it is parsed: over this many JSON values
    # (parsing holds the event loop ~0.3 us per value) it gets 413
    max_body_values: int = ranged(250_000, POSITIVE)
    # a call that sends no seed (Claude Code, Codex, litellm send none) is seeded from this, its rollout id and
    # its prompt's token ids: the same conversation samples the same tokens, in any order of arrival
    sampling_seed: int | None = ranged(None, SEED, why="or null: calls without a seed sample unseeded")

    def __post_init__(self) -> None:
        from gyre.config.validate import check_proxy

        check_proxy(self)


@dataclass
class TaskConfig:
    """Where tasks come from (gyre/tasks/source.py): builtin families, or a suite on disk at `path`."""

    # builtin | harbor (a directory of task dirs) | swebench (a JSONL file)
    source: str = choice(TaskSourceKind.builtin, TaskSourceKind, "task source")
    path: str = ""  # harbor: directory of tasks (or one task); swebench: instances JSONL; relative: to the cwd
    repos: str = ""  # swebench: directory of repository snapshots (owner__name); empty: <path's dir>/repos
    # train | eval (held out) | all: which instances of a suite on disk the run uses
    split: str = choice(TaskSplit.train, TaskSplit)
    # share of a suite's instances held out for eval (by a hash of the instance id)
    eval_fraction: float = ranged(0.25, Range(0, 1, high_open=True))
    # a suite on disk: a task that cannot be loaded is skipped and listed (summary, shard provenance);
    # strict refuses the suite instead; fewer usable tasks than min_tasks refuses to start, naming the causes
    strict: bool = False
    min_tasks: int = ranged(1, Range(low=1), why="a run needs a task")  # see tasks.strict
    # built-in task families (tasks.source=builtin): write_value, echo_files, fix_value, ...
    families: list[str] = field(default_factory=lambda: ["write_value"])
    # the RL training set: this many instances (families in equal shares, or a seeded sample of the split),
    # revisited in shuffled epochs; 0 = fresh instances every step (builtin) or the whole split (suites on disk)
    pool_size: int = ranged(8, NON_NEGATIVE, why="0: fresh instances every step, or the whole split")
    check_timeout_s: float = ranged(10.0, POSITIVE)  # seconds a task's hidden checks may take
    tool_delay_s: float = ranged(0.0, NON_NEGATIVE)  # extra seconds per run_checks call of the built-in harness
    # every tool call of the built-in harness takes this long on average (builds, tests): a long-tailed
    # workload. Each rollout draws a factor ~ lognormal(mean 1, sigma tool_time_sigma) from its rollout id
    tool_time_s: float = ranged(0.0, NON_NEGATIVE, why="0: no simulated tool time")
    tool_time_sigma: float = ranged(1.0, NON_NEGATIVE)  # see tasks.tool_time_s
    # harbor: build each task's environment/Dockerfile with buildah (gyre/tasks/images.py; once per definition,
    # cached in $GYRE_CACHE) and run its rollouts and grading in the image; false: the host's /usr
    build_images: bool = False
    images: str = ""  # a directory of base images FROM names (OCI archives name_tag.tar); see tools/make_base_images

    def __post_init__(self) -> None:
        from gyre.config.validate import check_tasks

        check_tasks(self)


@dataclass
class HarnessConfig:
    """The agent program each rollout runs (gyre/harness); presets: `harness=builtin|claude_code|mini_swe_agent|codex`."""

    kind: str = choice(HarnessKind.builtin, HarnessKind, "harness")  # builtin | claude_code | mini_swe_agent | codex
    max_turns: int = ranged(10, AT_LEAST_1)  # model calls of the main agent per rollout
    timeout_s: float = ranged(90.0, POSITIVE)  # wall-clock limit of a rollout (the workspace is graded as it stands)
    # builtin and mini_swe_agent; Claude Code sends its own
    temperature: float = ranged(1.0, NON_NEGATIVE, why="0: greedy")
    # builtin and mini_swe_agent; Claude Code asks for 64000 (cap it: proxy.max_output_tokens)
    max_tokens: int = ranged(64, AT_LEAST_1)
    concurrency: int = ranged(16, AT_LEAST_1)  # harnesses a cell runs at once (grading runs outside)
    keep_workspaces: bool = False  # keep each rollout's workspace under the output directory
    # the short prompt: claude_code `claude --bare` (a one-line system prompt, tools Bash/Edit/Read: ~300 tokens);
    # mini_swe_agent compact system/instance templates (gyre/harness/mini_swe_agent.py: a first request of ~80 tokens, not ~850);
    # codex one-line instructions, no environment context, no view_image (gyre/harness/codex.py)
    bare: bool = False
    # builtin only (Claude Code does all three itself): what real harnesses do besides the agent loop, each making
    # a rollout a tree of context paths. compact_tokens: compact a thread (a summary call, role main_summary or
    # subagent_summary) once it is estimated this many tokens long, like Claude Code's CLAUDE_CODE_AUTO_COMPACT_WINDOW
    # (0: never); subagents: after its first turn the main agent hands a task's delegable sub-tasks
    # (gyre/tasks/families.py: write_values, echo_files) to sub-agents (role subagent); reply_retries: re-send a
    # request whose reply has no usable tool call, the dropped reply a dead branch
    compact_tokens: int = ranged(0, NON_NEGATIVE, why="0: never compact")
    subagents: bool = False
    reply_retries: int = ranged(0, NON_NEGATIVE)

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

    backend: str = choice(SandboxBackend.bwrap, SandboxBackend, "sandbox backend")  # bwrap | apptainer | none
    apptainer_image: str = ""  # backend=apptainer: the image (.sif) harnesses and checkers run in
    # backend=apptainer: a task's environment image (Harbor's docker_image, a SWE-bench instance's image) -> .sif;
    # once given, a task whose image is not here fails; tasks naming no image use apptainer_image
    apptainer_images: dict[str, str] = field(default_factory=dict)
    file_size_mb: int = ranged(256, AT_LEAST_1)  # RLIMIT_FSIZE: largest file a sandboxed process may write
    open_files: int = ranged(1024, AT_LEAST_1)  # RLIMIT_NOFILE
    # processes (and threads) of one sandbox: RLIMIT_NPROC, and a pids cgroup where the run is root (the
    # kernel does not apply RLIMIT_NPROC to processes of host root, which the sandbox's user maps to)
    processes: int = ranged(4096, AT_LEAST_1)
    memory_mb: int = ranged(4096, AT_LEAST_1)  # RLIMIT_AS of every sandboxed process (address space, not resident)
    tmp_mb: int = ranged(1024, AT_LEAST_1)  # size of the sandbox's /tmp (a tmpfs: host memory, charged only as written)
    home_mb: int = ranged(512, AT_LEAST_1)  # size of the sandbox's HOME (a tmpfs, as /tmp)
    # bytes on disk the workspace (a host directory) may hold: checked about every second, the harness killed
    # beyond (the agent's failure); the grader refuses more than 2 GiB on disk in any case
    workspace_mb: int = ranged(2048, AT_LEAST_1)
    # connections one sandbox may hold to its model API endpoint at once (beyond: HTTP 429 from the relay)
    relay_connections: int = ranged(64, AT_LEAST_1)
    seccomp: bool = True  # the seccomp filter (gyre/sandbox/seccomp.py) in isolated sandboxes
    env: list[str] = field(default_factory=list)  # host environment variables passed in besides the allowlist

    def __post_init__(self) -> None:
        from gyre.config.validate import check_sandbox

        check_sandbox(self)


class MismatchProximal(StrEnum):
    """Whose logprobs are GSPO's old policy (rl.mismatch.proximal)."""

    engine = "engine"  # the rollout engine's, recorded with each call (no extra forward)
    trainer = "trainer"  # the trainer's, recomputed before the update (a no-grad forward per micro-batch)


class MismatchCorrection(StrEnum):
    """How the trainer/engine ratio pi_proximal / pi_engine of each sampled token reweights its loss."""

    none = "none"
    tis = "tis"  # truncated importance sampling: weight min(ratio, cap)
    mask = "mask"  # IcePop / MIS: weight ratio inside [low, high], no loss outside


class CorrectionLevel(StrEnum):
    token = "token"  # each token's own ratio
    sequence = "sequence"  # its rollout's: the geometric mean over the rollout's trained targets, as GSPO's ratio


@dataclass
class MismatchConfig:
    """Train/inference mismatch correction (gyre/train/mismatch.py; docs/architecture.md, "Train/inference mismatch")."""

    # GSPO's old policy: engine (recorded logprobs) or trainer (recomputed before the update)
    proximal: MismatchProximal = MismatchProximal.engine
    # none, tis (truncate the ratio at cap) or mask (no loss outside [low, high])
    correction: MismatchCorrection = MismatchCorrection.none
    level: CorrectionLevel = CorrectionLevel.token  # token or sequence ratios for the correction
    cap: float = ranged(2.0, Range(low=1), why="tis: below 1 it would cut on-policy tokens")  # tis: largest weight
    # mask: lowest ratio kept
    low: float = ranged(0.5, Range(0, 1, low_open=True), why="mask: the band must hold ratio 1 (no mismatch)")
    # mask: highest ratio kept
    high: float = ranged(2.0, Range(low=1), why="mask: the band must hold ratio 1 (no mismatch)")

    def __post_init__(self) -> None:
        from gyre.config.validate import check_mismatch

        check_mismatch(self)


@dataclass
class RLConfig:
    algorithm: str = choice(RLAlgorithm.gspo, RLAlgorithm)  # the policy-gradient objective
    # 4 leaves a hard task's group all-fail too often: no advantage, nothing learned
    group_size: int = ranged(8, Range(low=2), why="advantages compare a group's rollouts: one alone trains nothing")
    groups_per_step: int = ranged(8, AT_LEAST_1)  # with tasks.pool_size 8: each step visits the training set once
    # the sequence ratio is clipped to [1 - clip_eps_low, 1 + clip_eps_high]
    clip_eps_low: float = ranged(3e-4, Range(0, 1, high_open=True))
    clip_eps_high: float = ranged(4e-4, NON_NEGATIVE)  # see rl.clip_eps_low
    # K: root-to-leaf paths of a rollout's tree trained per step
    max_trajectories_per_rollout: int = ranged(5, AT_LEAST_1)
    # tempered: softmax(logits / T); truncated: renormalised over the top-k/top-p/min-p kept set
    logprob_distribution: LogprobDistribution = LogprobDistribution.tempered
    # the step's loss is averaged over: all_rollouts (every rollout that entered the objective, zero advantage
    # included: the GSPO paper's and TRL's choice) or with_signal (only rollouts with a non-zero advantage)
    loss_norm: str = choice(LossNorm.all_rollouts, LossNorm)
    # a step with every rollout excluded (an infrastructure failure: nothing scored, nothing trained), or more
    # than this fraction of them, counts as failed; max_excluded_steps failed steps in a row stop the run with
    # the exclusion reasons counted (0: never stop)
    max_excluded_fraction: float = ranged(0.5, UNIT_INTERVAL)
    max_excluded_steps: int = ranged(1, NON_NEGATIVE, why="0: never stop")  # see rl.max_excluded_fraction
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    # rollout routing replay (mixture-of-experts models): the engine returns the experts it routed every token to,
    # the proxy records them with the call, the shards store them and the trainer routes each token the same way
    routing_replay: bool = False

    def __post_init__(self) -> None:
        from gyre.config.validate import check_rl

        check_rl(self)


@dataclass
class TrainConfig:
    backend: str = choice(TrainBackend.megatron, TrainBackend)  # the trainer (gyre/train: megatron-core)
    # RL learning rate (AdamW); 0 freezes the policy: each update is computed and applied as zero, so runs of
    # the same seeds (and proxy.sampling_seed) do the same work whatever the scheduler (tools/bench_schedulers.py)
    lr: float = ranged(1e-3, NON_NEGATIVE, why="0: a frozen policy")
    weight_decay: float = ranged(0.0, NON_NEGATIVE)  # AdamW weight decay
    adam_beta2: float = ranged(0.95, Range(0, 1, high_open=True))  # AdamW beta2
    grad_clip: float = ranged(1.0, NON_NEGATIVE, why="0: no clipping")  # gradient norm clip
    # tokens of a tree micro-batch; a bigger tree is trained exactly in segments
    micro_batch_tokens: int = ranged(4096, AT_LEAST_1)
    num_threads: int = ranged(1, AT_LEAST_1)  # on 2 shared cores one thread beats two (measured 5x)
    # Megatron tensor parallel over a cell's ranks (gloo on CPU, NCCL on GPU)
    tensor_parallel: int = ranged(1, AT_LEAST_1)
    pipeline_parallel: int = ranged(1, AT_LEAST_1)  # Megatron pipeline stages over a cell's ranks
    # CUDA only, like tensor/pipeline parallel > 1 (torchrun or srun world)
    context_parallel: int = ranged(1, AT_LEAST_1)
    # on: megatron's Transformer Engine layer spec (CUDA; padded micro-batches only, tree plans need the local
    # spec); auto: on when CUDA and transformer_engine are importable; off: local spec everywhere
    transformer_engine: str = choice(TransformerEngine.off, TransformerEngine)
    distributed_optimizer: bool = True  # CUDA: megatron's DDP + distributed optimizer; CPU: torch AdamW
    # MoE models: megatron expert parallel over a cell's ranks (each holds num_experts / expert_parallel experts)
    expert_parallel: int = ranged(1, AT_LEAST_1)


@dataclass
class WarmStartConfig:
    enabled: bool = True  # SFT on demonstrations before RL (not with model.path)
    # short on purpose: the policy starts able but unreliable, which leaves RL something to show on the embedded
    # default; the default's SFT learns to copy the task's word only after ~240 steps (its loss sits at 0.075,
    # every policy token but that word right, then falls to 0.01), so 200 steps left a policy that writes a
    # random word (success 0.02) and RL no group with a reward to compare
    steps: int = ranged(250, NON_NEGATIVE, why="0: no warm start")
    lr: float = ranged(2e-3, POSITIVE)  # warm-start learning rate
    batch_size: int = ranged(16, AT_LEAST_1)  # packed rows per warm-start step
    pack_tokens: int = ranged(384, AT_LEAST_1)  # tokens of a packed row
    demos: int = ranged(2000, AT_LEAST_1)  # demonstrations generated for the warm start
    families: list[str] = field(default_factory=list)  # demonstrations' families; empty: tasks.families
    # where tokenizer, warm start, images and tools are cached
    cache_dir: str = "${oc.env:GYRE_CACHE,${oc.env:HOME}/.cache/gyre}"


@dataclass
class CellResources:
    """One cell's share of a Slurm allocation: one component of the heterogeneous job."""

    nodes: int = ranged(1, AT_LEAST_1)  # nodes of the cell
    # ranks of the cell on each node; the cell's trainer world is nodes x tasks_per_node ranks, one Megatron
    # layout of train.tensor_parallel x pipeline_parallel (rank 0 of the cell leads: engine, control plane)
    tasks_per_node: int = ranged(1, AT_LEAST_1)
    cpus_per_node: int = ranged(1, AT_LEAST_1)  # sbatch --cpus-per-task for the cell's ranks
    gpus_per_node: int = ranged(0, NON_NEGATIVE)  # sbatch --gpus-per-node
    mem: str = ""  # per node, Slurm syntax ("64G"); empty: the partition's default
    partition: str = "debug"  # sbatch --partition
    time: str = "01:00:00"  # sbatch --time


@dataclass
class MooncakeConfig:
    """The cluster fabric as Mooncake Transfer Engine sees it (weights and KV between cells)."""

    protocol: str = choice(MooncakeProtocol.tcp, MooncakeProtocol)  # tcp | rdma
    device_name: str = ""  # RDMA NICs, e.g. "mlx5_0,mlx5_1"; empty: let Mooncake choose
    metadata_server: str = "P2PHANDSHAKE"  # Mooncake's metadata service; P2PHANDSHAKE: none, peers exchange it directly


@dataclass
class ClusterConfig:
    """Where cells run. slurm: one heterogeneous job, component 0 the core cell, 1..N the satellites."""

    backend: str = choice(
        ClusterBackend.local, ClusterBackend
    )  # local: processes on this machine; slurm: launch/submit.py
    job_name: str = "gyre"  # sbatch --job-name
    account: str = ""  # sbatch --account
    qos: str = ""  # sbatch --qos
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
    preempt_grace_s: int = ranged(120, NON_NEGATIVE, why="0: no signal")
    # the cell job's start: rank 0 marks the MPI world up once every rank is past MPI_Init; a start that
    # fails or hangs before that (PMI-2 start-ups do, now and then, on a loaded machine) is ended and run again
    mpi_start_timeout_s: int = ranged(120, AT_LEAST_1)
    mpi_start_attempts: int = ranged(3, AT_LEAST_1)  # see cluster.mpi_start_timeout_s
    core: CellResources = field(default_factory=CellResources)  # the core cell (authoritative weights and optimizer)
    # the other cells, one heterogeneous-job component each
    satellites: list[CellResources] = field(default_factory=lambda: [CellResources(), CellResources()])
    mooncake: MooncakeConfig = field(default_factory=MooncakeConfig)


@dataclass
class CommConfig:
    """The control plane and weight/KV transfer between cells (gyre/comm); Mooncake's fabric is
    `cluster.mooncake`."""

    transfer_backend: str = choice(
        TransferBackend.mooncake, TransferBackend
    )  # mooncake | gloo (torch.distributed fallback)
    # the address peers reach this rank at (its engine, Mooncake, gloo), resolved once on the rank's node:
    # "auto": this node's host name resolved there (a loopback answer is refused once the job spans hosts)
    hostname: str = "127.0.0.1"
    interface: str = ""  # with hostname=auto: the address of this network interface instead (eth0, ib0)
    idle_poll_max_s: float = ranged(0.02, POSITIVE)  # longest sleep between control-plane probes while idle


@dataclass
class SchedConfig:
    """Cells under one MPI job (scheduler=elastic|async|colocate_cells): rank 0 the controller, ranks
    1..C the cells (C = 1 + len(cluster.satellites)), cell 1 the core (gyre/sched)."""

    # concurrent rollout sessions one rollout cell serves (its KV budget): a session holds its slot while its
    # harness runs, not while it is graded. elastic: when training waits and no cell trains, the core leaves with
    # its sessions, rerouted to the cells left serving, which then hold more until enough of them end
    capacity_per_cell: int = ranged(8, AT_LEAST_1)
    # async/elastic: rollouts of step s may start once weights of version s - staleness exist
    staleness: int = ranged(1, NON_NEGATIVE, why="0: rollouts never run ahead of the weights")
    # async: cells fixed to rollout (0: every satellite; the core trains)
    async_rollout_cells: int = ranged(0, NON_NEGATIVE, why="0: every satellite")
    micro_batches_in_flight: int = ranged(1, AT_LEAST_1)  # per training cell; more hides the controller round trip
    # which queued session takes a freed slot: group_length: the oldest step's, a group not yet started first,
    # then the group whose rollouts have run longest (gyre/sched/policy/admission.py); fifo: as submitted
    admission: str = choice(Admission.group_length, Admission)
    kv_migration: bool = True  # move in-flight requests' keys/values with them when a cell leaves rollout
    # CPU set of each rank ("0-1", "0,2"), controller first; empty: controller on all CPUs, cell i on CPU (i-1) mod n
    cpu_sets: list[str] = field(default_factory=list)
    threads_per_cell: int = ranged(1, AT_LEAST_1)  # torch threads of each cell's trainer and engine
    cell_timeout_s: float = ranged(120.0, POSITIVE)  # a cell that answers nothing for this long is declared dead
    # a run that lost cells (rank gone, silent, or an engine unreachable or failing every call) finishes without
    # them and lists them in summary.json's dead_cells; it exits non-zero (DEAD_CELLS_EXIT_CODE) unless this is set
    allow_dead_cells: bool = False
    mpirun: str = ""  # empty: the mpirun next to this Python (MPICH from PyPI)
    faults: list[str] = field(default_factory=list)  # injected faults, e.g. "kill_cell:3:after_micro_batches:1"


@dataclass
class TrackingConfig:
    """Where `logger=tensorboard|wandb` sends the run (metrics.jsonl is always written: the source of truth)."""

    run_name: str = ""  # empty: the Hydra job's overrides (one run per multirun job), else the output dir's name
    wandb_project: str = "gyre"  # the W&B project of logger=wandb
    # offline: compute nodes often have no internet; `wandb sync <run dir>` later
    wandb_mode: str = choice(WandbMode.offline, WandbMode)

    def __post_init__(self) -> None:
        check_fields(self, "tracking.")


@dataclass
class EvalTaskConfig(TaskConfig):
    """`eval.tasks`: a task group like `tasks` (used with eval.held_out=false), its values refused under its own
    key."""

    def __post_init__(self) -> None:
        from gyre.config.validate import check_tasks

        check_tasks(self, "eval.tasks.")


@dataclass
class EvalConfig:
    """Held-out evaluation (gyre/eval): during the run every `every` steps, and on its own (launch/eval.py).
    Eval rollouts run through the run's harness, proxy, sandbox and grader; they are never trained."""

    every: int = ranged(0, NON_NEGATIVE, why="0: no evaluation during the run")  # steps between evals
    # true: the held-out split of the training suite (builtin: instances the training pool never holds, from
    # other seeds, plus held_out_families; a suite on disk: its tasks.split=eval); false: eval.tasks as given
    held_out: bool = True
    tasks: EvalTaskConfig = field(
        default_factory=EvalTaskConfig
    )  # with held_out=false: the eval tasks (a group like `tasks`)
    # builtin, held_out=true: families evaluated though never trained on (a variant the training pool lacks)
    held_out_families: list[str] = field(default_factory=lambda: ["echo_files"])
    samples: int = ranged(4, AT_LEAST_1)  # rollouts per task: n of pass@k (k = 1 .. samples)
    temperature: float = ranged(1.0, NON_NEGATIVE, why="0: greedy")  # sampling temperature of eval rollouts
    # tasks per eval (builtin: instances drawn; a suite: a seeded sample); 0: every task of the suite
    max_tasks: int = ranged(8, NON_NEGATIVE, why="0: every task of the suite")
    # launch/eval.py: a checkpoint directory (a run's checkpoint/) to evaluate; empty: model.path or the warm start
    checkpoint: str = ""


@dataclass
class RunConfig:
    # RL steps (optimizer updates) of the run
    steps: int = ranged(24, AT_LEAST_1, why="a run of no steps trains nothing")
    seed: int = ranged(0, SEED)  # seed of the training set, task sampling and harness sampling
    # colocate: one cell alternates rollout and training; elastic, async, colocate_cells: see docs/architecture.md;
    # conf/config.yaml (`make run`) sets elastic
    scheduler: str = choice(Scheduler.colocate, Scheduler, "scheduler")
    output_dir: str = ""  # empty: Hydra's run directory (outputs/<date>_<time>)
    # checkpoint period in steps (written in the background, off the step's critical path)
    checkpoint_every: int = ranged(1, NON_NEGATIVE, why="0: at the end only")
    # write each checkpoint on a background thread from a snapshot, off the step's critical path (gyre/resume)
    checkpoint_async: bool = True
    # auto: continue from output_dir/checkpoint/ when it is complete, else start at step 0; must: continue or
    # fail; never: start at step 0, moving an earlier run's outputs aside (gyre/resume/recovery.py)
    resume: str = choice(ResumeMode.auto, ResumeMode)
    # experiment trackers beside metrics.jsonl: jsonl, tensorboard, wandb; several at once: logger=[tensorboard,wandb]
    logger: list[str] = choice(lambda: [Logger.jsonl.value], Logger)
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
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        from gyre.config.validate import check_eval, check_task_sandbox

        check_fields(self)  # every section's fields, keyed from the top (cluster.satellites.1.nodes)
        check_task_sandbox(self)
        check_eval(self)
