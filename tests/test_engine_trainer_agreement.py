"""The behaviour logprobs the engine returns equal the trainer's logprobs for the same weights and tokens."""

import asyncio

import pytest
import torch

from gyre.config.schema import ModelConfig, TrainConfig
from gyre.engine.client import EngineClient, SamplingParams
from gyre.engine.launcher import start_engine
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.tokenizer import Tokenizer
from gyre.train.megatron_trainer import MegatronTrainer

pytestmark = pytest.mark.integration


def test_engine_logprobs_equal_trainer_logprobs_after_training_and_weight_sync(tmp_path):
    torch.manual_seed(0)
    tok = Tokenizer.train(["the quick brown fox jumps over the lazy dog " * 4], 300)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=64, num_layers=2, num_attention_heads=4,
                      num_query_groups=2, ffn_hidden_size=128)  # fmt: skip
    trainer = MegatronTrainer(cfg, TrainConfig(lr=1e-2, num_threads=1))
    ckpt = save_hf_checkpoint(tmp_path / "v0", trainer.hf_state_dict(), cfg, None)
    prompts = [torch.randint(0, cfg.vocab_size, (n,)).tolist() for n in (5, 17, 40)]

    class Batch:
        tokens = torch.tensor([prompts[2]])

    async def sample_all(client):
        params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7)
        return await asyncio.gather(*(client.generate(p, params) for p in prompts))

    def check(results):
        for prompt, res in zip(prompts, results, strict=True):
            seq = torch.tensor([prompt + res.output_ids])
            with torch.no_grad():
                ref = trainer.token_logprobs(seq)[0, len(prompt) - 1 :]
            assert len(res.output_logprobs) == len(res.output_ids) > 0
            assert torch.allclose(torch.tensor(res.output_logprobs), ref, atol=1e-4), (res.output_logprobs, ref)

    engine = start_engine(ckpt, num_threads=1, weights_dirs=[tmp_path])
    try:

        async def scenario():
            client = EngineClient(engine.url)
            try:
                check(await sample_all(client))  # concurrent requests, batched decode, fresh weights
                trainer.train_step([Batch()], lambda lp, b: (-lp.mean(), {}))
                path = save_hf_checkpoint(tmp_path / "v1", trainer.hf_state_dict(), cfg, None)
                await client.update_weights_from_disk(str(path), "1")
                results = await sample_all(client)
                assert all(r.weight_version == "1" for r in results)
                check(results)  # the same agreement after a training step and a weight sync
            finally:
                await client.close()

        asyncio.run(scenario())
    finally:
        engine.stop()
