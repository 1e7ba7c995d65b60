"""The lines a GPU cell runs and a CPU cell does not (gyre/sched/cell/world.py, gyre.train.model_parallel's
trainer_backend and rank_device), run here with torch.cuda faked to show 8 devices: the backend, the GPU each
rank takes, and the world it starts. The gloo path runs for real in tests/test_elastic_run.py (cells of 2 ranks).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from gyre.sched.cell import world
from gyre.sched.replica import flat_grads, set_flat_grads
from gyre.train import model_parallel
from gyre.train.model_parallel import rank_device, trainer_backend

pytestmark = pytest.mark.unit


class OneRankComm:
    """The mpi4py calls init_trainer_world makes, for a world of one rank."""

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 1

    def bcast(self, value: object, root: int = 0) -> object:
        return value


@pytest.fixture
def eight_gpus(monkeypatch):
    """torch.cuda as a node of 8 GPUs shows it; the devices each rank makes current are recorded."""
    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    return current


def test_the_backend_follows_the_device_a_rank_trains_on():
    assert trainer_backend(torch.device("cpu")) == "gloo"
    assert trainer_backend(torch.device("cuda", 3)) == "nccl"
    assert trainer_backend() == ("nccl" if torch.cuda.is_available() else "gloo")


def test_without_cuda_every_rank_trains_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")  # CI's machines have none; the gpu tier runs on ones that do
    assert rank_device(5) == torch.device("cpu")


def test_each_rank_takes_the_gpu_of_its_node_local_rank(eight_gpus):
    assert [rank_device(r) for r in (0, 7)] == [torch.device("cuda", 0), torch.device("cuda", 7)]
    assert eight_gpus == [0, 7]
    with pytest.raises(RuntimeError, match=r"rank 8 of its node sees 8 GPU.*cluster.\*.tasks_per_node"):
        rank_device(8)


def test_a_gpu_cells_world_is_nccl_on_the_ranks_gpu(eight_gpus, monkeypatch):
    started = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: started.update(backend=backend, **kw))
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert world.init_trainer_world(OneRankComm(), "127.0.0.1", local_rank=3) == "nccl"
    assert eight_gpus == [3] and (started["backend"], started["rank"], started["world_size"]) == ("nccl", 0, 1)
    assert isinstance(started["store"], dist.TCPStore)
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"  # NCCL's bootstrap on the interface of the rank's address
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")


def test_a_cpu_cells_world_is_gloo(monkeypatch):
    started = {}
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: started.update(backend=backend, **kw))
    monkeypatch.setattr(model_parallel.torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert world.init_trainer_world(OneRankComm(), "127.0.0.1", local_rank=0) == "gloo"
    assert started["backend"] == "gloo"
    with pytest.raises(ValueError):
        world.init_trainer_world(OneRankComm(), "auto", local_rank=0)  # an address, resolved, not a placeholder


def test_gradients_between_cells_go_through_megatrons_ddp_buffers_where_it_keeps_them():
    """On GPU megatron's DDP accumulates into `param.main_grad` and its optimizer reads only that: the sum of
    the cells' gradients must land there (on CPU, torch's optimizer reads `.grad`)."""
    ddp_like = torch.nn.Linear(3, 2)
    for p in ddp_like.parameters():
        p.main_grad = torch.full_like(p, 2.0)  # what megatron's DDP attaches
    flat, has = flat_grads(ddp_like)
    assert flat.device.type == "cpu" and flat.tolist() == [2.0] * 8 and has.tolist() == [1, 1]
    set_flat_grads(ddp_like, torch.arange(8.0), torch.tensor([1, 0], dtype=torch.uint8))
    assert ddp_like.weight.main_grad.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert ddp_like.bias.main_grad.tolist() == [0.0, 0.0] and ddp_like.weight.grad is None
    plain = torch.nn.Linear(3, 2)
    set_flat_grads(plain, torch.arange(8.0), torch.tensor([1, 0], dtype=torch.uint8))
    assert plain.weight.grad.flatten().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and plain.bias.grad is None
