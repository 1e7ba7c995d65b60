"""The SGLang backend's process handling and role-switch sequences, run for real.

The sequences speak SGLang's protocol only, so on CPU they drive the embedded engine; launching SGLang
itself on this machine fails (its CUDA dependencies are absent), which is the failure path tested.
"""

import asyncio
import sys

import pytest
import torch

from gyre.config.schema import EngineConfig
from gyre.engine.client import EngineClient, EngineError, SamplingParams
from gyre.engine.engine import EngineServers
from gyre.engine.launcher import EngineStartError, start_engine
from gyre.engine.sglang_backend import start_sglang_server, wait_until_serving
from gyre.engine.switch import join_rollout, leave_rollout
from gyre.model.hf_io import load_hf_state, save_hf_checkpoint
from gyre.model.random_model import SHAPES, create_random_model

pytestmark = pytest.mark.integration


def test_role_switch_keeps_requests_in_flight_and_loads_new_weights(tmp_path):
    cfg = SHAPES["qwen3-tiny"]
    model = create_random_model(tmp_path / "v0", cfg, seed=0, dtype=torch.float32)
    (model / "tokenizer.json").unlink()  # no EOS: every request runs to max_new_tokens, across the switch
    _, state = load_hf_state(model)
    v1 = save_hf_checkpoint(tmp_path / "v1", {k: v * 1.5 for k, v in state.items()}, cfg, None)

    async def scenario(url: str) -> None:
        client = EngineClient(url)
        try:
            params = SamplingParams(max_new_tokens=1000, seed=1)  # still decoding when the switch starts
            inflight = [asyncio.create_task(client.generate([3, 4, 5, i], params)) for i in range(3)]
            await asyncio.sleep(0.2)
            servers = EngineServers([url])
            down = await asyncio.to_thread(leave_rollout, servers, "retract")
            info = await client.server_info()
            assert info["paused"] and info["memory_released"] == ["kv_cache", "weights"]
            with pytest.raises(EngineError, match="503"):
                await client.generate([1, 2], SamplingParams(max_new_tokens=2))
            up = await asyncio.to_thread(join_rollout, servers, lambda: servers.update_weights_from_disk(v1, "1"))
            results = await asyncio.gather(*inflight)
            assert all(r.finish_reason == "length" and len(r.output_ids) == 1000 for r in results)
            assert all(r.weight_version == "1" for r in results)  # finished under the new weights
            assert down.total_s > 0 and up.sync_s > 0 and up.total_s >= up.sync_s
            assert (await client.server_info())["memory_released"] == []
        finally:
            await client.close()

    with start_engine(model, num_threads=1, weights_dirs=[tmp_path]) as engine:  # v1 is a sibling of v0
        assert wait_until_serving(engine, timeout_s=60) is engine  # /health_generate answers
        asyncio.run(scenario(engine.url))


def test_a_failed_sglang_launch_reports_its_log(tmp_path):
    cfg = EngineConfig(backend="sglang", python=sys.executable, startup_timeout_s=120)
    with pytest.raises(EngineStartError, match=r"exited with code \d+ before serving[\s\S]*Error"):
        start_sglang_server(tmp_path / "no-model", cfg, log_path=tmp_path / "sglang.log")
    assert (tmp_path / "sglang.log").read_text()
    with pytest.raises(EngineStartError, match="set engine.python"):
        start_sglang_server(tmp_path / "no-model", EngineConfig(backend="sglang", python="/nonexistent/python"))
