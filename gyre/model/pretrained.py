"""A run's starting model from a local HF-format directory (`model.path`), checked before any step.

The directory is what transformers' save_pretrained writes for a Qwen3, Qwen3-MoE, Qwen2 (without attention biases) or
Llama decoder: config.json, model.safetensors or model.safetensors.index.json with its shards, and the
tokenizer (tokenizer.json, tokenizer_config.json; the chat template in tokenizer_config.json or
chat_template.jinja). Its config.json defines the architecture (the run's other model.* architecture keys
are not used), its weights the starting policy, its tokenizer the proxy's and the engines'.

What the code cannot honour fails here, naming the file or key: another architecture, RoPE scaling,
sliding windows, biases, weights that do not fit the config, a tokenizer without gyre's chat tokens or with
more tokens than the model's vocabulary, a chat template missing or rendering otherwise than gyre's (the
proxy renders gyre/model/chat_template.py's ChatML, token in / token out; model.chat_template=gyre accepts
the difference: the model is then prompted in gyre's format, not its own), a context longer than
max_position_embeddings, a tensor-parallel size that does not divide the heads or vocabulary.

Imports no torch (the launcher checks a config before starting anything heavy).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.config.schema import ModelConfig
from gyre.config.validate import ConfigValueError

if TYPE_CHECKING:
    from gyre.config.schema import RunConfig
    from gyre.model.tokenizer import Tokenizer

# config.json's architectures -> model_type, for the decoders gyre's models implement
ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
}
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

# a conversation of every kind the proxy renders: system prompt, tools, a tool call, a tool result
_PROBE_TOOLS = [
    {"type": "function", "function": {"name": "write_file", "description": "Write a file.",
     "parameters": {"type": "object", "properties": {"path": {}, "content": {}}, "required": ["path"]}}},
]  # fmt: skip
_PROBE_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Create a.txt"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "write_file", "arguments": '{"path": "a.txt"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "wrote a.txt"},
    {"role": "assistant", "content": "done"},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip


class ModelDirError(ConfigValueError):
    """model.path names a directory the run cannot start from."""


def _fail(path: Path, why: str) -> None:
    raise ModelDirError(f"model.path={str(path)!r}: {why}")


def model_config_from_hf(config: dict) -> ModelConfig:
    """Qwen2/Qwen3/Llama-style config.json -> ModelConfig; refuses features the models here lack."""
    if config.get("attention_bias") or config.get("qkv_bias") or config.get("mlp_bias"):
        raise ValueError("config.json asks for attention biases (Qwen2.5 style) or MLP biases; gyre's models have none")
    rope = _rope_parameters(config)
    if config.get("use_sliding_window") or config.get("rope_scaling") or rope.get("rope_type", "default") != "default":
        raise ValueError("config.json uses sliding-window attention or scaled RoPE, which gyre's models lack")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json has hidden_act={config['hidden_act']!r}; gyre's models use SwiGLU (silu)")
    heads = config["num_attention_heads"]
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return dataclasses.replace(_dense_config(config, heads, head_dim), **_moe_fields(config))


def _moe_fields(config: dict) -> dict[str, Any]:
    """Qwen3-MoE's routing keys (transformers' Qwen3MoeConfig); a dense config has none."""
    if config.get("model_type") != "qwen3_moe":
        return {}
    if config.get("shared_expert_intermediate_size"):
        raise ValueError("config.json has shared experts (shared_expert_intermediate_size), which Qwen3-MoE lacks")
    aux = float(config.get("router_aux_loss_coef", 0.001)) if config.get("output_router_logits") else 0.0
    return {
        "num_experts": int(config["num_experts"]),
        "num_experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(config.get("decoder_sparse_step", 1)),
        "mlp_only_layers": [int(i) for i in config.get("mlp_only_layers") or []],
        "router_aux_loss_coef": aux,  # transformers adds it to the loss only with output_router_logits
    }


def _rope_parameters(config: dict) -> dict:
    return config.get("rope_parameters") or {}  # transformers 5 moved rope_theta here


def _dense_config(config: dict, heads: int, head_dim: int) -> ModelConfig:
    rope = _rope_parameters(config)
    return ModelConfig(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config.get("num_key_value_heads") or config["num_attention_heads"],
        ffn_hidden_size=config["intermediate_size"],
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        head_dim=0 if head_dim * heads == config["hidden_size"] else head_dim,
        qk_layernorm=config.get("model_type") in ("qwen3", "qwen3_moe"),
    )


def pretrained_model_config(model: ModelConfig) -> ModelConfig:
    """The architecture of model.path's config.json (with model.seed, model.path of the run's config)."""
    path = Path(model.path).expanduser()
    config_file = path / "config.json"
    if not config_file.is_file():
        _fail(path, f"no {config_file}: give an HF-format model directory (config.json, safetensors, tokenizer)")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        _fail(path, f"{config_file} is not JSON: {e}")
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES or config.get("model_type") != ARCHITECTURES[archs[0]]:
        _fail(path, f"{config_file} has architectures={archs} and model_type={config.get('model_type')!r}; "
                    f"gyre trains {', '.join(f'{a} ({t})' for a, t in ARCHITECTURES.items())}")  # fmt: skip
    try:
        cfg = model_config_from_hf(config)
    except (ValueError, KeyError) as e:
        _fail(path, f"{config_file}: {e}")
    run_keys = {"seed": model.seed, "init_std": model.init_std, "chat_template": model.chat_template}
    return dataclasses.replace(cfg, path=str(path.resolve()), **run_keys)


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF weight names and shapes of a model of cfg (lm_head included)."""
    head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    h, q, kv = (
        cfg.hidden_size,
        cfg.num_attention_heads * head_dim,
        cfg.num_query_groups * head_dim,
    )
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   }  # fmt: skip
        shapes |= _mlp_shapes(cfg, i)
        if cfg.qk_layernorm:
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    return shapes


def _mlp_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A dense SwiGLU, or Qwen3-MoE's router (mlp.gate) and experts (mlp.experts.E.*) as transformers saves them."""
    from gyre.model.moe import expert_ffn_size, is_moe_layer

    p, h = f"model.layers.{layer}.mlp.", cfg.hidden_size
    if not is_moe_layer(cfg, layer):
        f = cfg.ffn_hidden_size
        return {p + "gate_proj.weight": (f, h), p + "up_proj.weight": (f, h), p + "down_proj.weight": (h, f)}
    f = expert_ffn_size(cfg)
    shapes = {p + "gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        q = f"{p}experts.{e}."
        shapes |= {q + "gate_proj.weight": (f, h), q + "up_proj.weight": (f, h), q + "down_proj.weight": (h, f)}
    return shapes


def weight_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, file) from the safetensors headers (no tensor is read)."""
    from safetensors import safe_open

    if (path / WEIGHTS_FILE).is_file():
        files = [WEIGHTS_FILE]
    elif (path / INDEX_FILE).is_file():
        files = sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
    else:
        _fail(path, f"no weights: expected {path / WEIGHTS_FILE} or {path / INDEX_FILE} with its shards")
    shapes = {}
    for name in files:
        if not (path / name).is_file():
            _fail(path, f"{path / INDEX_FILE} names the shard {name}, which is missing")
        with safe_open(str(path / name), framework="numpy") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[key] = (tuple(f.get_slice(key).get_shape()), name)
    return shapes


def check_weights(path: Path, cfg: ModelConfig) -> None:
    want = expected_hf_shapes(cfg)
    got = weight_shapes(path)
    if cfg.tie_embeddings:
        want.pop("lm_head.weight")
        got.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or unexpected:
        _fail(path, f"the weights do not fit {path / 'config.json'}: missing {missing[:5]}, unexpected "
                    f"{unexpected[:5]} ({len(missing)} and {len(unexpected)} in all)")  # fmt: skip
    for name, shape in want.items():
        if got[name][0] != shape:
            _fail(path, f"{got[name][1]}: {name} has shape {got[name][0]}, config.json implies {shape}")


def chat_template_of(path: Path) -> str | None:
    """The directory's chat template: chat_template.jinja, else tokenizer_config.json's chat_template."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    config_file = path / "tokenizer_config.json"
    template = json.loads(config_file.read_text()).get("chat_template") if config_file.is_file() else None
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def render_hf_template(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """Render a chat template as transformers does (sandboxed jinja, trim_blocks, lstrip_blocks, tojson)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
    return env.from_string(template).render(messages=messages, tools=tools, add_generation_prompt=True)


def check_chat_template(path: Path) -> None:
    from gyre.model.chat_template import render_text

    template = chat_template_of(path)
    if not template:
        _fail(path, f"no chat template (neither {path / 'chat_template.jinja'} nor chat_template in "
                    f"{path / 'tokenizer_config.json'}); the proxy needs one")  # fmt: skip
    want = render_text(_PROBE_MESSAGES, _PROBE_TOOLS)
    try:
        got = render_hf_template(template, _PROBE_MESSAGES, _PROBE_TOOLS)
    except Exception as e:  # a template's own raise_exception, or jinja's errors
        _fail(path, f"its chat template fails on a tool-calling conversation: {e}")
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        _fail(path, f"its chat template renders a conversation otherwise than gyre's proxy does (ChatML with "
                    f"compact tool signatures, gyre/model/chat_template.py), from character {first}: "
                    f"{got[first:first + 60]!r} where gyre renders {want[first:first + 60]!r}. Replace the "
                    "chat_template in tokenizer_config.json (and chat_template.jinja) by gyre's CHAT_TEMPLATE_JINJA, "
                    "or set model.chat_template=gyre to train the model on gyre's format anyway")  # fmt: skip


def load_tokenizer(path: Path, cfg: ModelConfig) -> Tokenizer:
    from gyre.model.tokenizer import Tokenizer

    if not (path / "tokenizer.json").is_file():
        _fail(path, f"no {path / 'tokenizer.json'} (a tokenizers-format tokenizer)")
    try:
        tokenizer = Tokenizer.load(path)
    except Exception as e:  # missing chat tokens, or a file tokenizers cannot read
        _fail(path, f"{path / 'tokenizer.json'}: {e}")
    if tokenizer.vocab_size > cfg.vocab_size:
        _fail(path, f"{path / 'tokenizer.json'} has {tokenizer.vocab_size} tokens, more than vocab_size="
                    f"{cfg.vocab_size} in config.json")  # fmt: skip
    return tokenizer


def check_pretrained(cfg: RunConfig) -> ModelConfig:
    """Every check of model.path against the run; returns the model's ModelConfig."""
    from gyre.config.validate import check_engine_for_model, check_model, check_routing_replay, check_train

    model = pretrained_model_config(cfg.model)
    path = Path(model.path)
    check_weights(path, model)
    load_tokenizer(path, model)
    if model.chat_template == "directory":
        check_chat_template(path)
    try:
        check_model(model)
        check_engine_for_model(cfg.engine, model)
        check_train(cfg.train, model)
        check_routing_replay(cfg.rl, model)
        if cfg.proxy.max_context_tokens > model.max_position_embeddings:
            raise ConfigValueError(f"proxy.max_context_tokens={cfg.proxy.max_context_tokens}: exceeds "
                                   f"model.max_position_embeddings={model.max_position_embeddings}")  # fmt: skip
    except ConfigValueError as e:
        _fail(path, f"{e} (model.* here: {path / 'config.json'})")
    return model
