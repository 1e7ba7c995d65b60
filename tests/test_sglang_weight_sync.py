"""Weights trainer shards -> SGLang, checked against SGLang 0.5.23's source and transformers' Qwen3 names.

Every (tensor, pipeline) rank's shard of a random Qwen3 model is cut as the trainer holds it (shard_state),
merged per stage as the stage's sender does, named with stage_hf_state, and compared with the HF directory
and with the parameter names transformers' Qwen3ForCausalLM declares; those names are then mapped as SGLang's
Qwen3ForCausalLM.load_weights maps them (its stacked_params_mapping, read from its source) onto attributes its
modules declare. Buckets are read back with SGLang's own FlattenedTensorBucket.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re

import pytest
import torch
from safetensors.torch import load_file
from sglang_io import parse_like_sglang, sglang_root

from gyre.engine.sglang_weights import (
    FLATTENED_BUCKET,
    distributed_metadata,
    flatten_bucket,
    stage_hf_state,
    weight_buckets,
    weight_group_name,
)
from gyre.model.random_model import SHAPES, create_random_model
from gyre.model.weights import hf_to_megatron
from gyre.train.shard_weights import _global_names, _tp_merge, shard_state, stage_layers

pytestmark = pytest.mark.unit
QWEN3 = dataclasses.replace(SHAPES["qwen3-tiny"], tie_embeddings=False, num_layers=4)  # PP 2 needs untied
QWEN3_MOE = SHAPES["qwen3-moe-tiny"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3")
    create_random_model(directory, QWEN3, seed=3, dtype=torch.bfloat16)
    return directory


def hf_tensors(directory) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in load_file(f).items()}


def senders_hf(full: dict[str, torch.Tensor], tp: int, pp: int, cfg=QWEN3) -> list[dict[str, torch.Tensor]]:
    """What each stage's sender sends: its TP group's shards merged (as the all-gather gives them), HF-named."""
    sent = []
    for stage in range(pp):
        shards = [shard_state(full, cfg, r, tp, stage, pp) for r in range(tp)]
        merged = {name: _tp_merge(name, [s[name] for s in shards]) for name in shards[0]}
        sent.append(stage_hf_state(_global_names(merged, stage_layers(cfg, stage, pp).start), cfg))
    return sent


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_each_stage_sends_its_own_tensors_under_transformers_qwen3_names(hf_dir, tp, pp):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = hf_tensors(hf_dir)
    sent = senders_hf(hf_to_megatron(hf, QWEN3), tp, pp)
    names = [n for part in sent for n in part]
    assert len(names) == len(set(names))  # no tensor sent twice
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    assert type(reference).__name__ == "Qwen3ForCausalLM" and set(names) == set(reference.state_dict()) == set(hf)
    for part in sent:
        for name, tensor in part.items():
            assert torch.equal(tensor, hf[name]), name
    if pp == 2:  # the first stage has the embedding and the first half of the layers, the last the head
        assert "model.embed_tokens.weight" in sent[0] and "lm_head.weight" in sent[1]
        assert {int(m) for n in sent[1] for m in re.findall(r"layers\.(\d+)\.", n)} == {2, 3}


@pytest.mark.parametrize("pp", [1, 2])
def test_qwen3_moe_stages_send_transformers_names_router_and_experts_included(tmp_path, pp):
    """Qwen3-MoE (gyre/model's qwen3-moe-tiny): the router and every expert under transformers' names, which
    SGLang's qwen3_moe loader maps onto its fused experts (make_expert_params_mapping over gate/up/down_proj)."""
    from transformers import AutoModelForCausalLM

    create_random_model(tmp_path, QWEN3_MOE, seed=5, dtype=torch.bfloat16)
    hf = hf_tensors(tmp_path)
    sent = senders_hf(hf_to_megatron(hf, QWEN3_MOE), 1, pp, QWEN3_MOE)
    names = [n for part in sent for n in part]
    # transformers fuses the experts in memory (its state_dict names differ), so its names are what it reads
    # from the directory: every one of them, and nothing else
    reference, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(reference).__name__ == "Qwen3MoeForCausalLM" and len(names) == len(set(names))
    assert set(names) == set(hf) and not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert all(torch.equal(t, hf[n]) for part in sent for n, t in part.items())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    loader = (sglang_root() / "srt/models/qwen3_moe.py").read_text()
    assert all(f'{k}="{v}"' in loader for k, v in [("ckpt_gate_proj_name", "gate_proj"),
               ("ckpt_down_proj_name", "down_proj"), ("ckpt_up_proj_name", "up_proj")])  # fmt: skip


def sglang_qwen3_mapping() -> list[tuple[str, str]]:
    """(param_name, shard_name) of stacked_params_mapping in SGLang's Qwen3ForCausalLM.load_weights."""
    tree = ast.parse((sglang_root() / "srt/models/qwen3.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen3ForCausalLM")
    load = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "load_weights")
    assign = next(
        n for n in ast.walk(load) if isinstance(n, ast.Assign) and n.targets[0].id == "stacked_params_mapping"
    )
    return [(e.elts[0].value, e.elts[1].value) for e in assign.value.elts]


def test_sglangs_qwen3_loader_maps_every_sent_name_onto_a_module_it_declares(hf_dir):
    mapping = sglang_qwen3_mapping()
    assert ("qkv_proj", "q_proj") in mapping and ("gate_up_proj", "up_proj") in mapping
    source = "".join((sglang_root() / f"srt/models/{m}.py").read_text() for m in ("qwen3", "qwen2"))
    declared = set(re.findall(r"self\.(\w+) = ", source))
    for name in hf_tensors(hf_dir):
        for param, shard in mapping:
            if shard in name:
                name = name.replace(shard, param)
                break
        modules = [p for p in name.split(".")[:-1] if not p.isdigit() and p not in ("model", "layers")]
        assert all(m in declared for m in modules), f"{name}: SGLang's Qwen3 declares no {modules}"


def sglang_bucket_class() -> type:
    spec = importlib.util.spec_from_file_location(
        "sglang_tensor_bucket", sglang_root() / "srt/weight_sync/tensor_bucket.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FlattenedTensorBucket


def test_buckets_are_read_back_by_sglangs_flattened_tensor_bucket():
    state = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(2, 2).to(torch.bfloat16),
             "d": torch.randn(1000)}  # fmt: skip
    buckets = weight_buckets(state, bucket_bytes=64)
    assert [list(b) for b in buckets] == [["a"], ["b", "c"], ["d"]]  # one dtype each; a tensor over the size alone
    bucket_cls = sglang_bucket_class()
    for bucket in buckets:
        names, dtypes, shapes = distributed_metadata(bucket)
        received = bucket_cls.empty(names, dtypes, shapes, "cpu")  # what the engine allocates from the request
        received.get_flattened_tensor().copy_(flatten_bucket(bucket))  # what the broadcast fills in
        for name, tensor in received.reconstruct_tensors():
            assert torch.equal(tensor, state[name]) and tensor.dtype == state[name].dtype
        request = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": weight_group_name(0, 1),
                   "weight_version": "3", "load_format": FLATTENED_BUCKET}  # fmt: skip
        parsed = parse_like_sglang("/update_weights_from_distributed", request)
        assert parsed.load_format == "flattened_bucket" and parsed.group_name == "gyre_weights_0_stage1"
