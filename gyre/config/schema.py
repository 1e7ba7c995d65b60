"""Typed configuration tree. Each component owns one dataclass; YAML in conf/ only sets values.

This module must import without torch, megatron, sglang or mooncake (tests check sys.modules).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 0
    max_context_tokens: int = 4096
    default_max_tokens: int = 96
    request_timeout_s: float = 300.0


@dataclass
class TaskConfig:
    suite: str = "builtin"
    families: list[str] = field(default_factory=lambda: ["write_value", "echo_files"])
    check_timeout_s: float = 10.0
    tool_delay_s: float = 0.0


@dataclass
class HarnessConfig:
    kind: str = "builtin"
    max_turns: int = 10
    timeout_s: float = 90.0
    temperature: float = 1.0
    max_tokens: int = 64
    concurrency: int = 16
    keep_workspaces: bool = False


@dataclass
class RLConfig:
    algorithm: str = "gspo"
    group_size: int = 8
    groups_per_step: int = 4
    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    max_trajectories_per_rollout: int = 5


@dataclass
class TrainConfig:
    backend: str = "megatron"
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta2: float = 0.95
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096
    num_threads: int = 1  # on 2 shared cores one thread beats two (measured 5x)


@dataclass
class WarmStartConfig:
    enabled: bool = True
    steps: int = 400
    lr: float = 2e-3
    batch_size: int = 16
    pack_tokens: int = 384
    demos: int = 2000
    cache_dir: str = "${oc.env:GYRE_CACHE,${oc.env:HOME}/.cache/gyre}"


@dataclass
class RunConfig:
    steps: int = 24
    seed: int = 0
    scheduler: str = "colocate"
    output_dir: str = ""  # empty: Hydra's run directory (outputs/<date>_<time>)
    checkpoint_every: int = 4
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    tasks: TaskConfig = field(default_factory=TaskConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
