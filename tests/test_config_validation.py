"""Config values the types cannot check: each error names the key, the value and what to change."""

import dataclasses

import pytest

from gyre.config.load import compose
from gyre.config.schema import EngineConfig, ModelConfig, TrainConfig
from gyre.config.validate import ConfigValueError, check_run, check_train
from gyre.model.random_model import SHAPES

pytestmark = pytest.mark.unit


def test_default_and_preset_configs_pass_every_check():
    check_run(compose())
    sglang = compose(["engine=sglang", "engine.tp_size=2"])
    check_run(dataclasses.replace(sglang, model=SHAPES["qwen3-0.6b"]))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["engine.backend=vllm"], "engine.backend='vllm': unknown engine backend; choose one of embedded, sglang"),
        (["engine.tp_size=2"], "engine.tp_size=2: the embedded engine runs on one device"),
        (["engine=sglang", "engine.mem_fraction_static=0"], r"engine.mem_fraction_static=0.0: must be in \(0, 1\)"),
        (["engine.dtype=fp8"], "engine.dtype='fp8': choose one of auto, float32, bfloat16, float16"),
        (["engine=sglang", "engine.load_format=gguf"], "engine.load_format='gguf'"),
        (["engine.device=tpu"], "engine.device='tpu': the embedded engine runs on 'cpu' or 'cuda"),
    ],
)
def test_bad_engine_values_fail_at_compose_time(override, message):
    with pytest.raises(ConfigValueError, match=message):
        compose(override)


def test_model_dependent_checks():
    cfg = compose(["engine=sglang", "engine.tp_size=8"])
    with pytest.raises(ConfigValueError, match="engine.tp_size=8: does not divide model.num_attention_heads=4"):
        check_run(cfg)
    odd = dataclasses.replace(compose(), model=ModelConfig(hidden_size=100, num_attention_heads=3, num_query_groups=3))
    with pytest.raises(ConfigValueError, match="model.hidden_size=100: is not divisible by num_attention_heads=3"):
        check_run(odd)
    with pytest.raises(ConfigValueError, match="model.num_query_groups=3: must divide"):
        check_run(dataclasses.replace(compose(), model=ModelConfig(num_query_groups=3)))
    with pytest.raises(ConfigValueError, match="train.tensor_parallel=4: must divide"):
        check_train(TrainConfig(tensor_parallel=4), ModelConfig())
    with pytest.raises(ConfigValueError, match="train.pipeline_parallel=3: must divide model.num_layers=4"):
        check_train(TrainConfig(pipeline_parallel=3), ModelConfig())
    with pytest.raises(ConfigValueError, match="train.tensor_parallel=2: must divide model.vocab_size=61"):
        check_train(TrainConfig(tensor_parallel=2), ModelConfig(vocab_size=61))
    with pytest.raises(ConfigValueError, match="train.pipeline_parallel=2: tied embeddings"):
        check_train(TrainConfig(pipeline_parallel=2), ModelConfig(tie_embeddings=True))
    cells = compose(["scheduler=elastic", "train.tensor_parallel=2"])
    with pytest.raises(ConfigValueError, match=r"cluster.core.tasks_per_node=1: cell 0 has 1 node\(s\) x 1 task"):
        check_run(cells)
    for cell in (cells.cluster.core, *cells.cluster.satellites):
        cell.tasks_per_node = 2
    check_run(cells)
    cells.cluster.core.gpus_per_node = 2  # a multi-rank GPU cell: an NCCL world, one rank per GPU (sched/cell/world.py)
    check_run(cells)
    with pytest.raises(ConfigValueError, match="train.context_parallel=2: Gyre trains on token trees"):
        check_run(compose(["train.context_parallel=2"]))  # refused before anything starts, not at the first step
    with pytest.raises(ConfigValueError, match="train.transformer_engine='yes'"):
        check_train(TrainConfig(transformer_engine="yes"), ModelConfig())
    assert EngineConfig(backend="sglang", tp_size=8).tp_size == 8  # valid alone; the model decides
