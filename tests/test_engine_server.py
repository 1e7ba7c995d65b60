"""The embedded engine server: batching, logprobs, prefix cache, control endpoints, launcher."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

from gyre.config.schema import ModelConfig
from gyre.engine.batcher import BatcherConfig, weight_version_spans
from gyre.engine.client import EngineClient, EngineError, SamplingParams
from gyre.engine.launcher import EngineStartError, start_engine
from gyre.engine.prefix_cache import PrefixCache
from gyre.engine.sampling import BatchSamplingParams, SamplingSpec, parse_sampling_params, sample_tokens
from gyre.engine.server import EngineServer, running
from gyre.model.hf_io import load_llama, save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.tokenizer import Tokenizer

SENTENCES = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Run the tests with pytest and read the failures carefully.",
    "<|im_start|>user\nFix the bug in utils.py<|im_end|>\n<|im_start|>assistant\n",
]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def _tiny_checkpoint(directory: Path, tokenizer_dir: Path, vocab_size: int, seed: int, eos_id: int) -> Path:
    cfg = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a zero row keeps <|im_end|> from ever being the greedy choice: long outputs
        model.lm_head.weight[eos_id] = 0.0
    return save_hf_checkpoint(directory, model.state_dict(), cfg, tokenizer_dir)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(SENTENCES * 4, vocab_size=300)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory, tokenizer: Tokenizer) -> tuple[Path, Path]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("ckpt")
    tok_dir = root / "tok"
    tokenizer.save(tok_dir)
    a = _tiny_checkpoint(root / "v0", tok_dir, tokenizer.vocab_size, 0, tokenizer.eos_id)
    b = _tiny_checkpoint(root / "v1", tok_dir, tokenizer.vocab_size, 1, tokenizer.eos_id)
    return a, b


@contextlib.asynccontextmanager
async def engine(
    model_dir: Path, admin_key: str | None = None, **config: int
) -> AsyncIterator[tuple[EngineServer, EngineClient]]:
    """An engine serving `model_dir` that loads weights from the checkpoints beside it; its client holds the key."""
    cfg = BatcherConfig(**{"max_context_tokens": 512, **config})
    server = EngineServer(str(model_dir), cfg, admin_key=admin_key, weights_dirs=[model_dir.parent])
    async with running(server) as url:
        client = EngineClient(url, timeout_s=60, admin_key=admin_key)
        try:
            yield server, client
        finally:
            await client.close()


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(asyncio.wait_for(coro, 30))


async def post(client: EngineClient, path: str, payload: object) -> tuple[int, object]:
    session = await client._http()
    async with session.post(client.base_url + path, data=json.dumps(payload)) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text


def decoding(server: EngineServer, rid: str, tokens: int = 3):  # noqa: ANN201
    """A predicate: request `rid` is running and has produced at least `tokens` tokens."""

    async def check() -> bool:
        return any(s.rid == rid and s.finish is None and len(s.output_ids) >= tokens for s in server.batcher.running)

    return check


async def wait_until(predicate, timeout: float = 20.0) -> None:  # noqa: ANN001
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


def prompts(tokenizer: Tokenizer) -> list[list[int]]:
    return [tokenizer.encode(s) for s in SENTENCES]


# ----- pure parts -----


@pytest.mark.unit
def test_sampling_follows_inverse_cdf_with_top_p_and_top_k() -> None:
    logits = torch.tensor([[0.7, 0.2, 0.1]]).log().repeat(1000, 1)
    grid = (torch.arange(1000) + 0.5) / 1000

    def counts(**kw: float) -> list[int]:
        spec = SamplingSpec(temperature=1.0, **kw)
        params = BatchSamplingParams.build([spec] * 1000, 3)
        tokens, logprobs, _ = sample_tokens(logits, params, grid)
        assert torch.allclose(logprobs, logits.gather(1, tokens[:, None])[:, 0], atol=1e-6)  # T=1: raw logprobs
        return torch.bincount(tokens, minlength=3).tolist()

    assert counts() == [700, 200, 100]
    assert counts(top_p=0.8) == [778, 222, 0]  # 0.7/0.9, 0.2/0.9
    assert counts(top_k=1) == [1000, 0, 0]
    assert counts(min_p=0.25) == [778, 222, 0]  # 0.1 < 0.25 * 0.7
    assert counts(min_p=0.5) == [1000, 0, 0]
    greedy = BatchSamplingParams.build([SamplingSpec(temperature=0.0)], 3)
    banned = torch.tensor([[True, False, False]])
    assert sample_tokens(logits[:1], greedy, None, banned)[0].tolist() == [1]


@pytest.mark.unit
def test_sampled_logprobs_are_tempered_and_truncated_by_hand() -> None:
    """Hand-computed: p = (0.7, 0.2, 0.1); at T=0.5 the tempered distribution is p^2 / 0.54."""
    logits = torch.tensor([[0.7, 0.2, 0.1]]).log()
    tempered = torch.tensor([0.49, 0.04, 0.01]) / 0.54
    for token, u in ((0, 0.1), (1, 0.95)):
        spec = SamplingSpec(temperature=0.5)
        out = sample_tokens(logits, BatchSamplingParams.build([spec], 3), torch.tensor([u]))
        assert out.tokens.tolist() == [token]
        assert out.logprobs.item() == pytest.approx(tempered[token].log().item(), abs=1e-6)
        assert out.truncated_logprobs.item() == pytest.approx(out.logprobs.item(), abs=1e-6)  # nothing truncated
        spec = SamplingSpec(temperature=0.5, top_k=2)  # keeps 0 and 1: mass 0.53 / 0.54
        out = sample_tokens(logits, BatchSamplingParams.build([spec], 3), torch.tensor([u]))
        assert out.logprobs.item() == pytest.approx(tempered[token].log().item(), abs=1e-6)
        assert out.truncated_logprobs.item() == pytest.approx(math.log([0.49, 0.04][token] / 0.53), abs=1e-6)
    greedy = BatchSamplingParams.build([SamplingSpec(temperature=0.0)], 3)
    banned = torch.tensor([[True, False, False]])
    assert sample_tokens(logits[:1], greedy, None, banned)[0].tolist() == [1]


@pytest.mark.unit
def test_sampling_params_validation() -> None:
    spec = parse_sampling_params({"temperature": 0, "stop_token_ids": [3], "max_new_tokens": 5}, 10)
    assert spec.greedy and spec.stop_token_ids == {3} and spec.max_new_tokens == 5
    for bad in (
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": 0},
        {"max_new_tokens": -1},
        {"min_new_tokens": 6, "max_new_tokens": 5},
        {"stop_token_ids": [10]},
        {"frequency_penalty": 0.5},
        {"min_p": 1.5},
        {"tempreature": 1.0},
        {"max_new_tokens": "5"},
    ):
        with pytest.raises(ValueError):
            parse_sampling_params(bad, 10)


@pytest.mark.unit
def test_prefix_cache_keeps_longest_entries_within_budget() -> None:
    cache = PrefixCache(max_tokens=10)

    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.arange(n).float().view(1, 1, n, 1), torch.zeros(1, 1, n, 1)

    cache.insert(torch.tensor([1, 2, 3]), *kv(3))
    cache.insert(torch.tensor([1, 2, 3, 4, 5]), *kv(5))  # extends the first: replaces it
    assert cache.stats()["entries"] == 1 and cache.tokens == 5
    n, k, _ = cache.match(torch.tensor([1, 2, 3, 4, 9, 9]), limit=5)
    assert n == 4 and k.shape[2] == 4
    assert cache.match(torch.tensor([1, 2, 3, 4, 5, 6]), limit=3)[0] == 3
    cache.insert(torch.tensor([7, 8, 9, 10]), *kv(4))
    cache.insert(torch.tensor([5, 5, 5]), *kv(3))  # over budget: the least recently used entry goes
    assert cache.tokens <= 10 and cache.match(torch.tensor([1, 2, 3]), limit=3)[0] == 0


@pytest.mark.unit
def test_weight_version_spans_follow_sglang() -> None:
    assert weight_version_spans([], "v0", 4) == [{"version": "v0", "start": 0, "end": 4}]
    spans = weight_version_spans([("v0", 3), ("v1", 5)], "v2", 9)
    assert spans == [
        {"version": "v0", "start": 0, "end": 3},
        {"version": "v1", "start": 3, "end": 5},
        {"version": "v2", "start": 5, "end": 9},
    ]


# ----- the server in this process, driven over HTTP -----


@pytest.mark.integration
def test_concurrent_greedy_requests_are_batched_and_match_sequential(ckpts, tokenizer) -> None:
    async def main() -> None:
        async with engine(ckpts[0]) as (server, client):
            alone = []
            for p in prompts(tokenizer):
                alone.append(await client.generate(p, GREEDY))
                await client.flush_cache()
            steps_before = server.batcher.steps
            together = await asyncio.gather(*(client.generate(p, GREEDY) for p in prompts(tokenizer)))
            steps = server.batcher.steps - steps_before
        for a, b in zip(alone, together, strict=True):
            assert a.output_ids == b.output_ids and len(a.output_ids) == GREEDY.max_new_tokens
            assert a.finish_reason == b.finish_reason == "length"
            assert torch.allclose(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4)
        assert steps < (GREEDY.max_new_tokens - 1) * len(together)  # one forward served several requests

    run(main())


@pytest.mark.integration
def test_logprobs_equal_a_full_forward(ckpts, tokenizer) -> None:
    model = load_llama(ckpts[0])
    sampling = [
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=3),
        SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=16, seed=4),
    ]

    async def main() -> list:
        async with engine(ckpts[0]) as (_, client):
            ps = prompts(tokenizer)
            return await asyncio.gather(*(client.generate(ps[i], s) for i, s in enumerate(sampling))), ps

    results, ps = run(main())
    for prompt, res, s in zip(ps[: len(results)], results, sampling, strict=True):
        seq = torch.tensor(prompt + res.output_ids)
        with torch.no_grad():
            logits, _ = model(seq[None, :-1], torch.arange(len(seq) - 1)[None])
        tempered = torch.log_softmax(logits[0] / s.temperature, -1)  # top-p truncation ignored (the default)
        ref = tempered.gather(1, seq[1:, None])[:, 0][len(prompt) - 1 :]
        assert torch.allclose(torch.tensor(res.output_logprobs), ref, atol=1e-4)


@pytest.mark.integration
def test_seeded_sampling_is_reproducible_in_any_batch(ckpts, tokenizer) -> None:
    seeded = SamplingParams(temperature=1.0, max_new_tokens=10, seed=11)

    async def main() -> None:
        async with engine(ckpts[0]) as (_, client):
            ps = prompts(tokenizer)
            alone = await client.generate(ps[0], seeded)
            others = [client.generate(p, SamplingParams(temperature=1.0, max_new_tokens=10)) for p in ps[1:]]
            batched, *_ = await asyncio.gather(client.generate(ps[0], seeded), *others)
            assert batched.output_ids == alone.output_ids

    run(main())


@pytest.mark.integration
def test_prefix_cache_reuse_gives_same_result(ckpts, tokenizer) -> None:
    async def main() -> None:
        async with engine(ckpts[0]) as (server, client):
            first = await client.generate(prompts(tokenizer)[3], GREEDY)
            assert first.cached_tokens == 0
            turn2 = prompts(tokenizer)[3] + first.output_ids + tokenizer.encode("\nnext turn")
            cached = await client.generate(turn2, GREEDY)
            await client.flush_cache()
            fresh = await client.generate(turn2, GREEDY)
            assert server.batcher.prefix.stats()["hits"] >= 1
            await client.flush_cache()
            group = await asyncio.gather(*(client.generate(prompts(tokenizer)[2], GREEDY) for _ in range(4)))
        assert cached.cached_tokens == len(prompts(tokenizer)[3]) + len(first.output_ids) - 1
        assert fresh.cached_tokens == 0
        assert cached.output_ids == fresh.output_ids
        assert torch.allclose(torch.tensor(cached.output_logprobs), torch.tensor(fresh.output_logprobs), atol=1e-5)
        # Samples of one prompt arriving together share its prefill.
        assert sorted(r.cached_tokens for r in group) == [0] + [len(prompts(tokenizer)[2]) - 1] * 3

    run(main())


@pytest.mark.integration
def test_stop_token_ids_max_new_tokens_and_min_new_tokens(ckpts, tokenizer) -> None:
    async def main() -> None:
        async with engine(ckpts[0]) as (_, client):
            p = prompts(tokenizer)[1]
            full = await client.generate(p, SamplingParams(temperature=0.0, max_new_tokens=8))
            assert full.finish_reason == "length" and len(full.output_ids) == 8
            stop = full.output_ids[2]
            cut = full.output_ids.index(stop) + 1
            stopped = await client.generate(p, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[stop]))
            assert stopped.finish_reason == "stop" and stopped.output_ids == full.output_ids[:cut]
            # SGLang's defaults: the matched stop token stays in output_ids but is trimmed from text.
            payload = {
                "input_ids": p,
                "sampling_params": {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [stop]},
            }
            status, body = await post(client, "/generate", payload)
            assert status == 200 and body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            assert body["text"] == tokenizer.decode(full.output_ids[: cut - 1], skip_special_tokens=True)
            # Stop strings end generation once the decoded text contains them; the text stops before them.
            stop_text = tokenizer.decode(full.output_ids[3:5])
            strings = {"temperature": 0, "max_new_tokens": 8, "stop": [stop_text], "skip_special_tokens": False}
            status, body = await post(client, "/generate", {"input_ids": p, "sampling_params": strings})
            produced = tokenizer.decode(body["output_ids"])
            assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_text}
            assert len(body["output_ids"]) <= 5 and body["text"] == produced[: produced.find(stop_text)]
            first = full.output_ids[0]
            payload["sampling_params"] |= {"stop_token_ids": [first], "min_new_tokens": 3}
            status, body = await post(client, "/generate", payload)
            assert status == 200 and first not in body["output_ids"][:3] and len(body["output_ids"]) >= 3

    run(main())


@pytest.mark.integration
def test_abort_returns_partial_output(ckpts, tokenizer) -> None:
    async def main() -> None:
        async with engine(ckpts[0]) as (server, client):
            long = SamplingParams(temperature=0.0, max_new_tokens=400)
            task = asyncio.create_task(client.generate(prompts(tokenizer)[0], long, rid="long"))

            await wait_until(decoding(server, "long", tokens=5))
            await client.abort("long")
            res = await task
            assert res.rid == "long" and res.finish_reason == "abort"
            assert 0 < len(res.output_ids) < 400 and len(res.output_logprobs) == len(res.output_ids)
            assert (await client.server_info())["num_running_reqs"] == 0
            # A client that goes away stops its request too.
            gone = asyncio.create_task(client.generate(prompts(tokenizer)[0], long, rid="gone"))
            await wait_until(decoding(server, "gone"))
            gone.cancel()

            async def idle() -> bool:
                return not server.batcher.running and not server.inflight

            await wait_until(idle)

    run(main())


@pytest.mark.integration
def test_pause_keeps_requests_and_continue_resumes(ckpts, tokenizer) -> None:
    long = SamplingParams(temperature=0.0, max_new_tokens=400)  # long enough to catch it running

    async def main() -> None:
        async with engine(ckpts[0]) as (server, client):
            p = prompts(tokenizer)[2]
            reference = await client.generate(p, long)
            await client.flush_cache()
            for mode in ("in_place", "retract"):
                task = asyncio.create_task(client.generate(p, long, rid=mode))
                await wait_until(decoding(server, mode))
                await client.pause_generation(mode)
                frozen = server.batcher.generated_tokens
                await asyncio.sleep(0.2)
                info = await client.server_info()
                assert info["paused"] and not task.done() and server.batcher.generated_tokens == frozen
                assert info["num_running_reqs"] + info["num_queued_reqs"] == 1
                await client.continue_generation()
                res = await task
                assert res.output_ids == reference.output_ids and res.finish_reason == "length"
            task = asyncio.create_task(client.generate(p, long, rid="abort"))
            await wait_until(decoding(server, "abort"))
            await client.pause_generation("abort")
            assert (await task).finish_reason == "abort"
            await client.continue_generation()

    run(main())


@pytest.mark.integration
def test_update_weights_from_disk_changes_outputs_and_version(ckpts, tokenizer) -> None:
    long = SamplingParams(temperature=0.0, max_new_tokens=400)

    async def main() -> None:
        async with engine(ckpts[0]) as (server, client):
            p = prompts(tokenizer)[0]
            before = await client.generate(p, GREEDY)
            assert before.weight_version == "default"
            # A request in flight across the update keeps going and records both versions.
            payload = {"input_ids": p, "sampling_params": long.to_payload(), "rid": "across"}
            task = asyncio.create_task(post(client, "/generate", payload))
            await wait_until(decoding(server, "across"))
            await client.pause_generation()
            n_before = len(server.batcher.running[0].output_ids)
            body = await client.update_weights_from_disk(str(ckpts[1]), "v1")
            assert body["success"] is True
            await client.continue_generation()
            status, spanned = await task
            assert status == 200 and spanned["meta_info"]["weight_version"] == "v1"
            assert spanned["meta_info"]["weight_versions"] == [
                {"version": "default", "start": 0, "end": n_before},
                {"version": "v1", "start": n_before, "end": long.max_new_tokens},
            ]
            after = await client.generate(p, GREEDY)
            info = await client.server_info()
            assert info["weight_version"] == "v1" and info["model_path"] == str(ckpts[1])
            assert after.weight_version == "v1" and after.output_ids != before.output_ids
            ref = load_llama(ckpts[1])
            seq = torch.tensor(p + after.output_ids)
            with torch.no_grad():
                logits, _ = ref(seq[None, :-1], torch.arange(len(seq) - 1)[None])
            expect = torch.log_softmax(logits[0], -1).gather(1, seq[1:, None])[:, 0][len(p) - 1 :]
            assert torch.allclose(torch.tensor(after.output_logprobs), expect, atol=1e-4)
            for bad in ("/nonexistent/ckpt", str(ckpts[0].parent / "tok")):
                with pytest.raises(EngineError) as err:
                    await client.update_weights_from_disk(bad, "v2")
                assert err.value.status == 400
            assert (await client.server_info())["weight_version"] == "v1"
            status, _ = await post(client, "/update_weight_version", {"new_version": "v1-relabelled"})
            assert status == 200 and (await client.generate(p, GREEDY)).weight_version == "v1-relabelled"

    run(main())


@pytest.mark.integration
def test_admin_routes_need_the_admin_key_and_weights_load_only_from_the_weights_dirs(
    ckpts, tokenizer, tmp_path
) -> None:
    admin = ["/abort_request", "/pause_generation", "/continue_generation", "/update_weights_from_disk",
             "/update_weight_version", "/release_memory_occupation", "/resume_memory_occupation", "/flush_cache",
             "/gyre/kv/export", "/gyre/kv/import", "/gyre/kv/release"]  # fmt: skip
    outside = tmp_path / "forged"
    shutil.copytree(ckpts[1], outside)  # a valid checkpoint, but not where the run writes weights

    async def main() -> None:
        async with engine(ckpts[0], admin_key="k-123") as (server, client):
            session = await client._http()
            for path in admin:
                for headers in ({"Authorization": ""}, {"Authorization": "Bearer k-12"}, {"Authorization": "k-123"}):
                    async with session.post(client.base_url + path, json={}, headers=headers) as resp:
                        assert resp.status == 401 and await resp.json() == {"error": "Unauthorized"}, path
            async with session.get(client.base_url + "/flush_cache", headers={"Authorization": ""}) as resp:
                assert resp.status == 401
            assert not server.batcher.paused and server.batcher.weight_version == "default"
            p = prompts(tokenizer)[0]
            async with session.post(client.base_url + "/generate", headers={"Authorization": ""},
                                    json={"input_ids": p, "sampling_params": GREEDY.to_payload()}) as resp:  # fmt: skip
                assert resp.status == 200  # generation, health and info stay open (as SGLang's do)
            for bad in (outside, ckpts[0].parent.parent):
                with pytest.raises(EngineError) as err:
                    await client.update_weights_from_disk(str(bad), "forged")
                assert err.value.status == 400 and "outside the run's weights directories" in str(err.value)
            assert (await client.server_info())["weight_version"] == "default"
            assert (await client.update_weights_from_disk(str(ckpts[1]), "v1"))["success"] is True

    run(main())


@pytest.mark.integration
def test_release_and_resume_memory(ckpts, tokenizer) -> None:
    async def main() -> None:
        async with engine(ckpts[0]) as (server, client):
            p = prompts(tokenizer)[1]
            before = await client.generate(p, GREEDY)
            stashes = set(Path(tempfile.gettempdir()).glob("gyre-engine-weights-*"))
            await client.release_memory()
            # the released weights wait in an unnamed file the kernel frees with the process (even on SIGKILL)
            assert set(Path(tempfile.gettempdir()).glob("gyre-engine-weights-*")) == stashes
            info = await client.server_info()
            assert info["memory_released"] == ["kv_cache", "weights"] and info["cache"]["kv"]["bytes"] == 0
            assert all(t.numel() == 0 for t in server.batcher.model.parameters())
            with pytest.raises(EngineError) as err:
                await client.generate(p, GREEDY)
            assert err.value.status == 503
            await client.resume_memory()
            after = await client.generate(p, GREEDY)
            assert after.output_ids == before.output_ids
            # Releasing while a request runs is refused: pause (retract or abort) first.
            task = asyncio.create_task(client.generate(p, SamplingParams(temperature=0.0, max_new_tokens=400), rid="r"))
            await wait_until(decoding(server, "r"))
            await client.pause_generation()
            with pytest.raises(EngineError) as err:
                await client.release_memory()
            assert err.value.status == 400 and "pause_generation" in str(err.value)
            await client.continue_generation()
            assert (await task).finish_reason == "length"

    run(main())


@pytest.mark.integration
def test_bad_payloads_get_400(ckpts, tokenizer) -> None:
    vocab = tokenizer.vocab_size

    async def main() -> None:
        async with engine(ckpts[0], max_context_tokens=64) as (_, client):
            bad = [
                {},
                {"sampling_params": {"max_new_tokens": 3}},
                {"input_ids": []},
                {"input_ids": [1, vocab]},
                {"input_ids": [1, "2"]},
                {"input_ids": [1, 2], "text": "hi"},
                {"input_ids": [1, 2], "sampling_params": {"temperature": -1}},
                {"input_ids": [1, 2], "sampling_params": {"top_p": 0}},
                {"input_ids": [1, 2], "sampling_params": {"unknown_knob": 1}},
                {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 63}},  # 2 + 63 > 64
                {"input_ids": [[1, 2], [3]], "stream": True},
                {"input_ids": [1, 2], "stream": "yes"},
                {"input_ids": [1, 2], "rid": 5},
                {"input_ids": [1, 2], "return_logprob": "yes"},
                {"input_ids": [1, 2], "logprob_start_len": 0},
                [1, 2, 3],
            ]
            for payload in bad:
                status, body = await post(client, "/generate", payload)
                assert status == 400, (payload, status, body)
                assert isinstance(body, dict) and body["message"], payload
            session = await client._http()
            async with session.post(client.base_url + "/generate", data=b"{not json") as resp:
                assert resp.status == 400 and "JSON" in (await resp.json())["message"]
            for path, payload in [
                ("/pause_generation", {"mode": "sideways"}),
                ("/update_weights_from_disk", {}),
                ("/abort_request", {"rid": 3}),
                ("/release_memory_occupation", {"tags": ["gpu"]}),
            ]:
                status, body = await post(client, path, payload)
                assert status == 400, (path, status, body)
            status, body = await post(
                client, "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}
            )
            assert status == 200 and len(body["output_ids"]) == 2  # still serving

    run(main())


@pytest.mark.integration
def test_streaming_text_input_and_batch(ckpts, tokenizer) -> None:
    async def main() -> None:
        async with engine(ckpts[0]) as (_, client):
            text = SENTENCES[1]
            params = {"temperature": 0, "max_new_tokens": 6, "skip_special_tokens": False}
            status, plain = await post(
                client, "/generate", {"text": text, "sampling_params": params, "return_logprob": True}
            )
            assert status == 200 and plain["meta_info"]["prompt_tokens"] == len(tokenizer.encode(text))
            assert plain["text"] == tokenizer.decode(plain["output_ids"])
            session = await client._http()
            chunks = []
            payload = {"text": text, "sampling_params": params, "return_logprob": True, "stream": True}
            async with session.post(client.base_url + "/generate", json=payload) as resp:
                assert resp.status == 200 and resp.content_type == "text/event-stream"
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        chunks.append(line[6:].strip())
            assert chunks[-1] == b"[DONE]"
            bodies = [json.loads(c) for c in chunks[:-1]]
            assert [len(b["output_ids"]) for b in bodies] == sorted(len(b["output_ids"]) for b in bodies)
            assert bodies[0]["meta_info"]["finish_reason"] is None or len(bodies) == 1
            final = bodies[-1]
            assert final["output_ids"] == plain["output_ids"] and final["text"] == plain["text"]
            assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
            lps = [lp for lp, _, _ in final["meta_info"]["output_token_logprobs"]]
            assert torch.allclose(
                torch.tensor(lps), torch.tensor([lp for lp, _, _ in plain["meta_info"]["output_token_logprobs"]])
            )
            status, batch = await post(
                client, "/generate", {"input_ids": prompts(tokenizer)[:2], "sampling_params": params, "rid": "b"}
            )
            assert status == 200 and [b["meta_info"]["id"] for b in batch] == ["b_0", "b_1"]
            assert (await client.health()) is True
            async with session.get(client.base_url + "/health_generate") as resp:
                assert resp.status == 200
            async with session.get(client.base_url + "/get_model_info") as resp:
                info = await resp.json()
                assert info["weight_version"] == "default" and info["eos_token_ids"] == [tokenizer.eos_id]

    run(main())


# ----- the CLI as a subprocess, through the launcher -----


@pytest.mark.integration
def test_launcher_runs_the_cli_and_reports_failures(ckpts, tokenizer, tmp_path) -> None:
    engine_proc = start_engine(ckpts[0], num_threads=1, max_context_tokens=256, startup_timeout_s=60)
    try:

        async def main() -> None:
            client = EngineClient(engine_proc.url)
            try:
                res = await client.generate(prompts(tokenizer)[0], GREEDY)
                assert len(res.output_ids) == GREEDY.max_new_tokens
                assert (await client.server_info())["max_context_tokens"] == 256
            finally:
                await client.close()

        run(main())
    finally:
        code = engine_proc.stop()
    assert not engine_proc.alive() and code == 0  # SIGTERM is a clean shutdown
    assert not engine_proc.log_path.exists()  # a temp log of a clean run is not left behind in /tmp
    with pytest.raises(EngineStartError, match="not a checkpoint") as err:
        start_engine(tmp_path / "missing", startup_timeout_s=60)
    failed_log = Path(str(err.value).split("log ", 1)[1].split(":\n", 1)[0])
    assert failed_log.exists()  # the log a failure names is kept
