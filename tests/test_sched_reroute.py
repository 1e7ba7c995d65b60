"""Taking an engine out of service mid-request: the harness-facing call completes on another engine with
the same greedy output, its prefix moved through Mooncake (nothing recomputed) or, without migration,
recomputed and counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from gyre.config.schema import ModelConfig, ProxyConfig
from gyre.engine.client import SyncEngineClient
from gyre.engine.launcher import EngineProcess, start_engine
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog
from gyre.proxy.server import ProxyServer
from gyre.sched.controller.reroute import take_out_of_service

pytestmark = pytest.mark.integration
MAX_TOKENS = 300
MESSAGES = [{"role": "user", "content": "Write the value 17 into the file out_3.txt and then stop. " * 3}]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Tokenizer, list[EngineProcess]]]:
    root = tmp_path_factory.mktemp("reroute")
    tokenizer = Tokenizer.train(
        [f"Write the value {i} into the file out_{i % 7}.txt and then stop." for i in range(300)], 320
    )
    tokenizer.save(root / "tok")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=128, num_layers=4, ffn_hidden_size=256)
    ckpt = save_hf_checkpoint(root / "ckpt", LlamaForCausalLM(cfg).state_dict(), cfg, root / "tok")
    engines = [start_engine(ckpt, log_path=root / f"engine{i}.log", weight_version="7") for i in range(2)]
    try:
        yield tokenizer, engines
    finally:
        for e in engines:
            e.stop()


def chat(url: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    return client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)


def server_info(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/get_server_info") as resp:
        return json.loads(resp.read())


def run_and_reroute(tokenizer: Tokenizer, a: str, b: str, migrate: bool) -> tuple[ProxyServer, object, dict]:
    """A call that starts on engine `a`, which leaves service after 20 generated tokens."""
    proxy = ProxyServer(tokenizer, [a], ProxyConfig(), CallLog())
    url = proxy.start()
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(resp=chat(url)))
    try:
        before = server_info(a)["internal_states"][0]["generated_tokens"]
        worker.start()
        deadline = time.monotonic() + 60
        while server_info(a)["internal_states"][0]["generated_tokens"] < before + 20:
            assert time.monotonic() < deadline and worker.is_alive(), "the call never got going on engine A"
            time.sleep(0.01)
        proxy.set_engines([a, b])
        report = take_out_of_service(a, proxy, migrate_kv=migrate)
        worker.join(60)
    finally:
        SyncEngineClient(a).continue_generation()
        proxy.stop()
    assert "resp" in out, "the harness-facing call failed"
    return proxy, report, out


def test_reroute_moves_the_prefix_and_recomputes_nothing(setup) -> None:
    tokenizer, (a, b) = setup
    proxy = ProxyServer(tokenizer, [b.url], ProxyConfig(), CallLog())
    reference = chat(proxy.start())
    proxy.stop()
    SyncEngineClient(b.url).flush_cache()  # B must not already hold the prefix

    proxy, report, out = run_and_reroute(tokenizer, a.url, b.url, migrate=True)
    (record,) = proxy.call_log.for_rollout("default")
    assert record.engine_url == b.url and record.weight_version == "7"
    assert out["resp"].choices[0].message.content == reference.choices[0].message.content
    assert len(record.output_ids) == reference.usage.completion_tokens
    assert report.sessions == 1 and not report.failed and report.tokens > len(record.input_ids)
    assert report.would_recompute == report.tokens  # B had none of it: rerouting alone would prefill it all
    assert proxy.dispatcher.continued == 1 and proxy.dispatcher.continued_recomputed_tokens == 0


def test_reroute_without_migration_recomputes_and_counts_it(setup) -> None:
    tokenizer, (a, b) = setup
    SyncEngineClient(b.url).flush_cache()
    proxy, report, out = run_and_reroute(tokenizer, a.url, b.url, migrate=False)
    (record,) = proxy.call_log.for_rollout("default")
    assert record.engine_url == b.url and report.sessions == 0
    assert proxy.dispatcher.continued == 1
    assert proxy.dispatcher.continued_recomputed_tokens >= len(record.input_ids) + 20 - 1
    assert out["resp"].usage.completion_tokens == len(record.output_ids)


def test_engine_death_mid_request_is_invisible_to_the_harness(setup, tmp_path: Path) -> None:
    tokenizer, (_, b) = setup
    victim = start_engine(b.model_path, log_path=tmp_path / "victim.log", weight_version="7")
    proxy = ProxyServer(tokenizer, [victim.url], ProxyConfig(), CallLog())
    url = proxy.start()
    out: dict = {}
    worker = threading.Thread(target=lambda: out.update(resp=chat(url)))
    try:
        worker.start()
        deadline = time.monotonic() + 60
        while server_info(victim.url)["num_running_reqs"] == 0:
            assert time.monotonic() < deadline, "the call never reached the victim engine"
            time.sleep(0.01)
        proxy.set_engines([victim.url, b.url])
        victim.proc.kill()  # SIGKILL mid-generation
        worker.join(60)
    finally:
        victim.stop()
        proxy.stop()
    assert "resp" in out and out["resp"].usage.completion_tokens > 0
    (record,) = proxy.call_log.for_rollout("default")
    assert record.engine_url == b.url and proxy.dispatcher.retries == 1


def test_a_leaving_engine_hands_on_the_cached_context_of_a_session_between_calls(setup) -> None:
    tokenizer, (a, b) = setup
    for e in (a, b):
        SyncEngineClient(e.url).flush_cache()
    proxy = ProxyServer(tokenizer, [a.url], ProxyConfig(), CallLog())
    url = proxy.start()
    try:
        first = chat(url)
        (rec,) = proxy.call_log.for_rollout("default")
        assert rec.engine_url == a.url
        proxy.set_engines([a.url, b.url])
        report = take_out_of_service(a.url, proxy)
        assert report.sessions == 0 and report.idle_sessions == 1 and not report.failed
        # all of its context but the last sampled token, which was never fed back through the model
        assert report.idle_tokens == len(rec.input_ids) + len(rec.output_ids) - 1
        # the session's next call extends that context: it goes to B, which has all of it cached
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        turn = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content}]
        turn.append({"role": "user", "content": "Again."})
        client.chat.completions.create(model="m", messages=turn, max_tokens=8, temperature=0)
        second = proxy.call_log.for_rollout("default")[-1]
        assert second.engine_url == b.url and second.cached_tokens >= len(rec.input_ids)
    finally:
        SyncEngineClient(a.url).continue_generation()
        proxy.stop()


@pytest.mark.unit
def test_sessions_on_an_engine_are_read_while_the_proxy_moves_them():
    """The controller's thread lists a cell's sessions (taking it out of rollout) while the proxy's event loop
    records where each call ran: `make run` died once of "OrderedDict mutated during iteration" there."""
    from gyre.proxy.dispatch import EngineDispatcher
    from gyre.proxy.routing import EngineRouter

    dispatcher = EngineDispatcher(EngineRouter(["http://a", "http://b"]), timeout_s=1.0)
    for i in range(20_000):
        dispatcher._remember(f"s{i}", "http://a")
    stop = threading.Event()

    def calls() -> None:
        i = 0
        while not stop.is_set():
            dispatcher._remember(f"s{i % 20_000}", "http://b" if i % 2 else "http://a")
            i += 1

    class Cycle:  # garbage whose collection runs Python code (__del__): the collector runs inside sessions_on's
        def __init__(self) -> None:  # allocations, and Python code there lets the other thread run
            self.me = self

        def __del__(self) -> None:
            time.sleep(0)

    writer = threading.Thread(target=calls)
    writer.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for _ in range(500):
                Cycle()
            assert len(dispatcher.sessions_on("http://a")) <= 20_000
    finally:
        stop.set()
        writer.join()
