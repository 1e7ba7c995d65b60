"""The training-side model: a megatron-core GPTModel with the architecture of gyre/model/llama.py.

Built for this rank's place in megatron's model-parallel layout (gyre/train/model_parallel.py): its
tensor-parallel shard of each layer, and with pipeline parallelism only its stage's layers (the
embedding on the first stage, the output layer on the last).

RoPE, RMSNorm, SwiGLU (or megatron's MoE layer for Qwen3-MoE models), grouped-query attention, no biases,
untied embeddings, fp32, megatron's local layer spec (no Transformer Engine) with tree-aware attention modules (see
gyre/train/tree_attention_megatron.py). On a machine without CUDA the CPU shim is applied first.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from gyre.config.schema import ModelConfig
from gyre.model.llama import head_dim_of
from gyre.model.moe import expert_ffn_size, is_moe_layer
from gyre.train.cpu_shim import apply_cpu_shim
from gyre.train.tree_attention_megatron import tree_layer_spec

# Without Apex / Transformer Engine megatron-core warns on import and when building the local spec;
# that is the expected setup here (local spec, torch norms), so those notices are silenced.
_NO_APEX_TE = r".*(Apex|Transformer Engine).*"
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=_NO_APEX_TE)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

if not moe_utils.HAVE_TE:  # megatron-core 0.16's router GEMM reads te_general_gemm unguarded when TE is missing
    moe_utils.te_general_gemm = None


def _moe_block_spec(config: TransformerConfig, transformer_engine: bool) -> TransformerBlockSubmodules:
    """megatron's block spec of dense and MoE layers (config.moe_layer_freq) for this stage, each layer tree-aware."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_APEX_TE)
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=transformer_engine, normalization="RMSNorm")
    if transformer_engine:
        return block
    return dataclasses.replace(block, layer_specs=[tree_layer_spec(spec) for spec in block.layer_specs])


def init_megatron_single_process() -> None:
    """A one-process world (gloo; NCCL on CUDA) and tensor/pipeline parallel size 1. Idempotent.

    If torch.distributed is already initialized (e.g. by a launcher) that world is reused. The world's
    store is in-process (HashStore): no port to pick, so no race with other processes picking theirs.
    """
    from gyre.train.model_parallel import trainer_backend  # imports this module: here, not at the top

    apply_cpu_shim()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=trainer_backend(),
            store=torch.distributed.HashStore(),
            world_size=1,
            rank=0,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def transformer_config(cfg: ModelConfig) -> TransformerConfig:
    if not cfg.head_dim and cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(
            f"hidden_size {cfg.hidden_size} must be divisible by num_attention_heads {cfg.num_attention_heads}"
            " (or set model.head_dim)"
        )
    if cfg.num_attention_heads % cfg.num_query_groups:
        raise ValueError(
            f"num_attention_heads {cfg.num_attention_heads} must be divisible by "
            f"num_query_groups {cfg.num_query_groups}"
        )
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        kv_channels=head_dim_of(cfg),
        qk_layernorm=cfg.qk_layernorm,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_std,
        params_dtype=torch.float32,
        bf16=False,
        fp16=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        cuda_graph_scope=[],
        # megatron splits the layers over the stages by the config's sizes, not by its process groups
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        **moe_transformer_fields(cfg),
    )


def moe_transformer_fields(cfg: ModelConfig) -> dict[str, Any]:
    """megatron's MoE layer with Qwen3-MoE's routing (transformers' Qwen3MoeTopKRouter): softmax over the router
    logits and the top-k kept; renormalised (norm_topk_prob) equals megatron's softmax over the top-k logits, not
    renormalised its pre-softmax top-k. Local experts one after another (SequentialMLP, no grouped GEMM), fp32
    router, the load-balancing loss only when model.router_aux_loss_coef > 0. Each router has megatron's RouterReplay,
    idle unless a forward replays the engine's routing (gyre/train/routing_replay.py)."""
    if not cfg.num_experts:
        return {}
    return {
        "num_moe_experts": cfg.num_experts,
        "moe_router_topk": cfg.num_experts_per_tok,
        "moe_ffn_hidden_size": expert_ffn_size(cfg),
        "moe_router_pre_softmax": not cfg.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if cfg.router_aux_loss_coef > 0 else "none",
        "moe_aux_loss_coeff": cfg.router_aux_loss_coef,
        "moe_layer_freq": [int(is_moe_layer(cfg, i)) for i in range(cfg.num_layers)],
        "moe_grouped_gemm": False,
        # the all-to-all dispatcher makes CUDA streams; the all-gather one runs on gloo
        "moe_token_dispatcher_type": "alltoall" if torch.cuda.is_available() else "allgather",
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "moe_enable_routing_replay": True,
    }


def build_gpt_model(cfg: ModelConfig, transformer_engine: bool = False) -> GPTModel:
    """A fresh GPTModel on CPU for this rank's shard and stage, its weights drawn from cfg.seed. Without
    megatron's groups set up (gyre.train.model_parallel.init_model_parallel) it makes a one-process world.

    transformer_engine=True (CUDA with Transformer Engine installed) takes megatron's TE layer spec:
    fused kernels, no tree-plan attention (dense masks only).
    """
    if not parallel_state.model_parallel_is_initialized():
        init_megatron_single_process()
    torch.manual_seed(cfg.seed)
    model_parallel_cuda_manual_seed(cfg.seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_APEX_TE)
        if transformer_engine:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm)
        else:
            # tree micro-batches pass a TreeAttentionPlan as the attention mask; tensor masks are unchanged
            layer_spec = tree_layer_spec(
                get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=cfg.qk_layernorm)
            )
    config = transformer_config(cfg)
    if cfg.num_experts:
        layer_spec = _moe_block_spec(config, transformer_engine)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=False,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=cfg.rope_theta,
    )
