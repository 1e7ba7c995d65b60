"""The proxy: OpenAI request validation, call log, TITO splicing, routing, and end to end against a real engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from gyre.config.schema import ModelConfig, ProxyConfig
from gyre.engine.client import EngineClient
from gyre.engine.launcher import EngineProcess, start_engine
from gyre.model.chat_template import (
    IM_END,
    TOOL_CALL_END,
    TOOL_CALL_START,
    AssistantTurn,
    assistant_body,
    parse_assistant_text,
    render_segments,
)
from gyre.model.hf_io import save_hf_checkpoint
from gyre.model.llama import LlamaForCausalLM
from gyre.model.tokenizer import Tokenizer
from gyre.proxy.call_log import CallLog, CallRecord, parse_tool_call_id, read_call_log, tool_call_id
from gyre.proxy.calls import cut_at_stop
from gyre.proxy.errors import ProxyError
from gyre.proxy.openai_api import KNOWN_FIELDS, Reply, completion_body, parse_chat_request, stream_chunks
from gyre.proxy.routing import EngineRouter
from gyre.proxy.server import ProxyServer
from gyre.proxy.tito import TitoRenderer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    }
]


def corpus() -> list[str]:
    lines = []
    for i in range(200):
        lines.append(f"Write the value {i} into the file out_{i % 7}.txt and then stop.")
        lines.append(json.dumps({"name": "write_file", "arguments": {"path": f"out_{i}.txt", "content": str(i * 3)}}))
        lines.append(f'{TOOL_CALL_START}{{"name": "read_file", "arguments": {{"path": "a{i}"}}}}{TOOL_CALL_END}')
        lines.append(f"The file was written. Done with task {i}.{IM_END}")
    return lines


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(corpus(), vocab_size=384)


def make_record(tok: Tokenizer, log: CallLog, rollout_id: str, reply_text: str, **kw) -> CallRecord:
    """A record as the proxy writes it, for a reply whose output ids are `reply_text` tokenized."""
    out = tok.encode(reply_text)
    content, calls = parse_assistant_text(reply_text)
    record = CallRecord(
        rollout_id=rollout_id,
        call_id=log.next_call_id(),
        api="openai",
        input_ids=kw.get("input_ids", [1, 2, 3]),
        output_ids=out,
        output_logprobs=[-0.5] * len(out),
        spliced=[],
        finish_reason="tool_calls" if calls else "stop",
        weight_version="0",
        engine_url="http://127.0.0.1:1",
        prompt_tokens=3,
        cached_tokens=0,
        t_start=0.0,
        t_end=1.0,
        content=content,
        tool_calls=calls,
    )
    log.add(record)
    return record


# ---------------------------------------------------------------- request validation


def base_body(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.unit
def test_all_documented_fields_are_accepted():
    body = base_body(
        tools=TOOLS,
        tool_choice="auto",
        temperature=0.5,
        top_p=0.9,
        max_tokens=10,
        max_completion_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        n=1,
        stop=["\n\n"],
        seed=3,
        user="u",
        parallel_tool_calls=True,
        logprobs=True,
        top_logprobs=0,
        presence_penalty=0,
        frequency_penalty=0,
        logit_bias={},
        response_format={"type": "text"},
        metadata={"a": "b"},
        store=False,
        reasoning_effort="low",
        service_tier="auto",
        modalities=["text"],
        prediction=None,
        audio=None,
        web_search_options=None,
    )
    assert set(body) <= KNOWN_FIELDS
    req = parse_chat_request(body, "default")
    assert (req.max_tokens, req.stop, req.seed, req.stream, req.include_usage) == (12, ["\n\n"], 3, True, True)
    assert req.tool_names == ["write_file"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (base_body(frobnicate=1), "frobnicate", "frobnicate"),
        (base_body(n=2), "n", "n=1"),
        (base_body(temperature=3), "temperature", "temperature"),
        (base_body(max_tokens=0), "max_tokens", "max_tokens"),
        (base_body(stop=["a", "b", "c", "d", "e"]), "stop", "stop"),
        ({"model": "m", "messages": []}, "messages", "non-empty"),
        ({"model": "m"}, "messages", "non-empty"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages", "wizard"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages", "content is required"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages", "string or a list"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages",
            "only text parts",
        ),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
        (
            {
                "model": "m",
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}
                ],
            },
            "messages",
            "not JSON",
        ),
        (base_body(tools=[{"type": "function"}]), "tools", "tools[0]"),
        (base_body(top_p=0), "top_p", "greater than 0"),  # engines refuse it: a 400 here, never an engine 502
        (base_body(seed=2**64), "seed", "seed"),
        (base_body(stream="yes"), "stream", "stream"),
        (base_body(max_tokens=2.0), "max_tokens", "integer"),
        (
            base_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"required": [[]]}}}]),
            "tools",
            "tools[0].function.parameters.required[0]",
        ),
    ],
)
def test_bad_requests_are_rejected_with_400(body, param, needle):
    with pytest.raises(ProxyError) as info:
        parse_chat_request(body, "default")
    err = info.value
    assert err.status == 400 and err.param == param and needle in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.unit
def test_text_parts_and_developer_role_are_normalised():
    body = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
    }
    req = parse_chat_request(body, "default")
    assert req.messages[0]["role"] == "system" and req.model == "m"


# ---------------------------------------------------------------- response shapes


def a_reply(**kw) -> Reply:
    args = {
        "content": "ok",
        "tool_calls": [{"name": "write_file", "arguments": {"path": "a", "content": "b"}}],
        "tool_call_ids": ["call_7_0"],
        "finish_reason": "tool_calls",
        "prompt_tokens": 10,
        "completion_tokens": 4,
    }
    return Reply(**{**args, **kw})


@pytest.mark.unit
def test_completion_body_has_openai_shape():
    body = completion_body("chatcmpl-1", 5, "m", a_reply())
    assert body["object"] == "chat.completion" and body["model"] == "m"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"] == "ok"
    (call,) = message["tool_calls"]
    assert call["id"] == "call_7_0" and call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"path": "a", "content": "b"}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"]["total_tokens"] == 14


@pytest.mark.unit
def test_stream_chunks_reassemble_into_the_reply():
    chunks = stream_chunks("chatcmpl-1", 5, "m", a_reply(), include_usage=True)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    args = "".join(
        d["function"].get("arguments", "") for c in chunks[:-1] for d in c["choices"][0]["delta"].get("tool_calls", [])
    )
    assert content == "ok" and json.loads(args) == {"path": "a", "content": "b"}


# ---------------------------------------------------------------- call log


@pytest.mark.unit
def test_call_log_ids_are_unique_across_threads(tokenizer, tmp_path):
    log = CallLog(tmp_path / "calls.jsonl")
    ids: list[int] = []
    lock = threading.Lock()

    def worker(rid: str) -> None:
        for _ in range(20):
            r = make_record(tokenizer, log, rid, "hello" + IM_END)
            with lock:
                ids.append(r.call_id)

    threads = [threading.Thread(target=worker, args=(f"r{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ids) == list(range(1, 81))
    assert [len(log.for_rollout(f"r{i}")) for i in range(4)] == [20] * 4
    lines = (tmp_path / "calls.jsonl").read_text().splitlines()
    assert len(lines) == 80 and json.loads(lines[0])["api"] == "openai"
    popped = log.pop_rollout("r0")
    assert len(popped) == 20 and log.for_rollout("r0") == [] and log.get(popped[0].call_id) is None
    assert len(log) == 60


@pytest.mark.unit
def test_a_written_call_log_reads_back_and_a_truncated_line_is_named(tokenizer, tmp_path):
    log = CallLog(tmp_path / "calls.jsonl")
    records = [make_record(tokenizer, log, "r0", "hello" + IM_END, input_ids=[1, 2, 3 + n]) for n in range(3)]
    assert read_call_log(tmp_path / "calls.jsonl") == records
    text = (tmp_path / "calls.jsonl").read_text()
    (tmp_path / "cut.jsonl").write_text(text[:-40])  # the last line half-written
    with pytest.raises(ValueError, match=r"cut\.jsonl:3 is not a call record: JSONDecodeError"):
        read_call_log(tmp_path / "cut.jsonl")


@pytest.mark.unit
def test_tool_call_ids_round_trip():
    assert parse_tool_call_id(tool_call_id(42, 3)) == 42
    assert parse_tool_call_id("call_abc") is None and parse_tool_call_id("toolu_1_2") is None


# ---------------------------------------------------------------- TITO


def tool_reply_text() -> str:
    call = {"name": "write_file", "arguments": {"path": "out_3.txt", "content": "9"}}
    return f"I will write it.{TOOL_CALL_START}{json.dumps(call)}{TOOL_CALL_END}{IM_END}"


def resent_assistant(record: CallRecord) -> dict:
    """The assistant turn as a harness re-sends it: arguments with other key order and spacing."""
    calls = [
        {
            "id": cid,
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(dict(reversed(c["arguments"].items())), indent=1)},
        }
        for cid, c in zip(record.tool_call_ids, record.tool_calls, strict=True)
    ]
    return {"role": "assistant", "content": record.content, "tool_calls": calls}


@pytest.mark.unit
def test_assistant_turns_are_spliced_by_tool_call_id_and_by_text(tokenizer):
    log = CallLog()
    renderer = TitoRenderer(tokenizer, log)
    first = make_record(tokenizer, log, "r", tool_reply_text())
    second = make_record(tokenizer, log, "r", "The file was written." + IM_END)
    messages = [
        {"role": "system", "content": "You write files."},
        {"role": "user", "content": "Write 9 into out_3.txt"},
        resent_assistant(first),
        {"role": "tool", "tool_call_id": first.tool_call_ids[0], "content": "ok"},
        {"role": "assistant", "content": "The file was written."},
        {"role": "user", "content": "Thanks"},
    ]
    # The re-serialized turn tokenizes differently from what the model produced.
    assert tokenizer.encode(assistant_body(messages[2])) != first.output_ids
    prompt = renderer.render("r", messages, TOOLS)
    assert [s.source_call_id for s in prompt.spliced] == [first.call_id, second.call_id]
    for span, rec in zip(prompt.spliced, (first, second), strict=True):
        assert prompt.input_ids[span.start : span.start + span.length] == rec.output_ids
    assert prompt.retokenized_turns == 0
    # Other rollouts never see these records.
    assert renderer.render("other", messages, TOOLS).retokenized_turns == 2


@pytest.mark.unit
def test_unknown_or_altered_turns_fall_back_to_text(tokenizer):
    log = CallLog()
    renderer = TitoRenderer(tokenizer, log)
    first = make_record(tokenizer, log, "r", tool_reply_text())
    altered = resent_assistant(first)
    altered["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": "elsewhere.txt", "content": "9"})
    messages = [
        {"role": "user", "content": "go"},
        altered,
        {"role": "tool", "tool_call_id": "call_1_0", "content": "ok"},
        {"role": "assistant", "content": "never generated"},
    ]
    prompt = renderer.render("r", messages, None)
    assert prompt.spliced == [] and prompt.retokenized_turns == 2
    expected = []
    for seg in render_segments(messages):
        expected += tokenizer.encode(assistant_body(seg.message) if isinstance(seg, AssistantTurn) else seg)
    assert prompt.input_ids == expected


@pytest.mark.unit
def test_truncated_output_is_closed_with_eos_and_prefixes_stay_stable(tokenizer):
    log = CallLog()
    renderer = TitoRenderer(tokenizer, log)
    first = make_record(tokenizer, log, "r", "Write the value 3 into")  # cut by max_tokens: no IM_END
    history = [{"role": "user", "content": "go"}]
    before = renderer.render("r", history, TOOLS).input_ids
    history += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "continue"}]
    after = renderer.render("r", history, TOOLS)
    (span,) = after.spliced
    assert after.input_ids[: len(before)] == before and span.start == len(before)
    assert after.input_ids[span.start + span.length] == tokenizer.eos_id


# ---------------------------------------------------------------- stop strings, routing


@pytest.mark.unit
def test_cut_at_stop_keeps_tokens_up_to_the_stop_string(tokenizer):
    ids = tokenizer.encode("The file was written. Done with task 5.")
    n, text = cut_at_stop(tokenizer, ids, ["Done", "zzz"])
    assert text == "The file was written. "
    assert "Done" in tokenizer.decode(ids[:n]) and "Done" not in tokenizer.decode(ids[: n - 1])
    assert cut_at_stop(tokenizer, ids, ["zzz"]) is None


@pytest.mark.unit
def test_router_picks_least_loaded_and_survives_engine_changes():
    router = EngineRouter(["http://a", "http://b"])
    first, second = router.acquire(), router.acquire()
    assert {first, second} == {"http://a", "http://b"}
    router.release("http://a")
    assert router.acquire() == "http://a"
    assert router.acquire(exclude=["http://a", "http://b"]) is None
    router.set_engines(["http://b", "http://c"])
    assert router.acquire() == "http://c"
    router.release("http://a")  # a request finishing on a removed engine is harmless
    assert router.in_flight() == {"http://b": 1, "http://c": 1}
    threads = [threading.Thread(target=router.set_engines, args=([f"http://e{i}"],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(router.engines()) == 1


@pytest.mark.unit
def test_router_sends_a_session_home_unless_home_is_much_busier():
    router = EngineRouter(["http://a", "http://b"], affinity_slack=1)
    assert router.acquire(home="http://b") == "http://b"  # 0 in flight on both: home
    assert router.acquire(home="http://b") == "http://b"  # b: 1, a: 0, within the slack
    assert router.acquire(home="http://b") == "http://a"  # b: 2, a: 0: too busy, go least-loaded
    assert router.acquire(home="http://gone") == "http://a"  # home left the pool (a: 1, b: 2)
    assert router.acquire(prefer="http://b", home="http://a") == "http://b"  # moved keys/values win
    strict = EngineRouter(["http://a", "http://b"], affinity_slack=-1)
    strict.acquire()
    assert strict.acquire(home="http://a") == "http://b"


# ---------------------------------------------------------------- end to end: real engines, real openai client

MEMO_MESSAGES = [
    {"role": "system", "content": "You write files."},
    {"role": "user", "content": "Write 9 into out_3.txt"},
]
MEMO_ARGS = {"path": "out_3.txt", "content": "9"}


def memorize_tool_call(model: LlamaForCausalLM, prompt: list[int], target: list[int]) -> None:
    """Overfit the tiny model on one reply so that greedy decoding of `prompt` emits a real tool call."""
    seq = torch.tensor([prompt + target])
    positions = torch.arange(seq.shape[1])[None]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        logits = model(seq[:, :-1], positions[:, :-1])[0][0, len(prompt) - 1 :]
        tgt = seq[0, len(prompt) :]
        loss = torch.nn.functional.cross_entropy(logits, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        others = logits.detach().scatter(1, tgt[:, None], float("-inf")).max(-1).values
        if (logits.detach().gather(1, tgt[:, None])[:, 0] - others).min() > 3.0:
            return
    raise AssertionError("the tiny model did not memorize the tool call; raise the step budget")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("proxy_model")
    tokenizer.save(root / "tok")
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    prompt = TitoRenderer(tokenizer, CallLog()).render("any", MEMO_MESSAGES, TOOLS).input_ids
    memorize_tool_call(model, prompt, tokenizer.encode(tool_reply_text()))
    return save_hf_checkpoint(root / "ckpt", model.state_dict(), cfg, root / "tok")


@pytest.fixture(scope="module")
def engines(model_dir):
    started: list[EngineProcess] = []
    threads = [threading.Thread(target=lambda: started.append(start_engine(model_dir))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(started) == 2, "an engine failed to start; see the engine log in the error above"
        yield started
    finally:
        for e in started:
            e.stop()


@contextlib.contextmanager
def running_proxy(tokenizer, urls: list[str], **cfg):
    server = ProxyServer(tokenizer, urls, ProxyConfig(**cfg), CallLog())
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def proxy(tokenizer, engines):
    with running_proxy(tokenizer, [engines[0].url]) as server:
        yield server


def client_for(base: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_raw(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.integration
def test_chat_completion_matches_the_call_record(proxy):
    client = client_for(proxy.url)
    resp = client.chat.completions.create(
        model="my-policy", messages=[{"role": "user", "content": "Write the value 4"}], max_tokens=8, logprobs=True
    )
    (record,) = proxy.call_log.for_rollout("default")
    assert resp.object == "chat.completion" and resp.model == "my-policy" and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length", "tool_calls")
    assert resp.usage.prompt_tokens == len(record.input_ids) == record.prompt_tokens
    assert resp.usage.completion_tokens == len(record.output_ids) <= 8
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(record.output_logprobs)
    assert (choice.message.content or "") == record.content
    assert record.engine_url == proxy.engines()[0] and record.api == "openai" and record.role == "main"
    assert record.weight_version == "default"
    assert record.t_start <= record.t_sent < record.t_answered <= record.t_end  # the engine's part of the call
    assert [m.id for m in client.models.list().data] == ["gyre-policy"]


@pytest.mark.integration
def test_streamed_tool_call_with_rollout_header(proxy):
    client = client_for(proxy.url, default_headers={"X-Rollout-Id": "hdr"})
    stream = client.chat.completions.create(
        model="m",
        messages=MEMO_MESSAGES,
        tools=TOOLS,
        temperature=0,
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
    (record,) = proxy.call_log.for_rollout("hdr")
    assert finish == "tool_calls" and record.finish_reason == "tool_calls"
    assert content == "I will write it."
    assert calls[0]["id"] == f"call_{record.call_id}_0" and calls[0]["name"] == "write_file"
    assert json.loads(calls[0]["arguments"]) == MEMO_ARGS
    assert usage.completion_tokens == len(record.output_ids) and record.tool_names == ["write_file"]
    assert record.output_ids[-1] == proxy.tokenizer.eos_id


@pytest.mark.integration
def test_multi_turn_tito_splices_exact_output_ids(proxy, tokenizer):
    client = client_for(f"{proxy.url}/rollout/tito")
    first = client.chat.completions.create(model="m", messages=MEMO_MESSAGES, tools=TOOLS, temperature=0, max_tokens=64)
    call = first.choices[0].message.tool_calls[0]
    # The harness re-serializes the arguments with another key order and spacing.
    resent = {
        "role": "assistant",
        "content": first.choices[0].message.content,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": json.dumps(dict(reversed(MEMO_ARGS.items())), indent=2),
                },
            }
        ],
    }
    history = [*MEMO_MESSAGES, resent, {"role": "tool", "tool_call_id": call.id, "content": "wrote 1 byte"}]
    second = client.chat.completions.create(model="m", messages=history, tools=TOOLS, seed=7, max_tokens=12)
    rec1, rec2 = proxy.call_log.for_rollout("tito")
    (span,) = rec2.spliced
    assert span.source_call_id == rec1.call_id and span.length == len(rec1.output_ids)
    assert rec2.input_ids[span.start : span.start + span.length] == rec1.output_ids
    assert rec2.input_ids[: len(rec1.input_ids)] == rec1.input_ids
    assert tokenizer.encode(assistant_body(resent)) != rec1.output_ids  # re-tokenizing would have drifted

    # The reply to the second call comes back as text (decoded from its recorded output ids), then a
    # reply the proxy never produced.
    reply2 = second.choices[0].message.model_dump(exclude_none=True)
    assert parse_assistant_text(tokenizer.decode(rec2.output_ids))[0] == (reply2.get("content") or "")
    history += [
        reply2,
        {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": "I never generated this."},
        {"role": "user", "content": "Go on."},
    ]
    client.chat.completions.create(model="m", messages=history, tools=TOOLS, seed=8, max_tokens=4)
    rec3 = proxy.call_log.for_rollout("tito")[2]
    assert [s.source_call_id for s in rec3.spliced] == [rec1.call_id, rec2.call_id]
    for s, source in zip(rec3.spliced, (rec1, rec2), strict=True):
        assert rec3.input_ids[s.start : s.start + s.length] == source.output_ids
    assert rec3.retokenized_turns == 1 and rec3.input_ids[: len(rec2.input_ids)] == rec2.input_ids
    with urllib.request.urlopen(f"{proxy.url}/health") as resp:
        health = json.loads(resp.read())
    assert health["retokenized_turns"] >= 1 and health["spliced_turns"] >= 3


@pytest.mark.integration
def test_stop_strings_cut_the_reply_and_the_record(proxy):
    client = client_for(f"{proxy.url}/rollout/stop")
    resp = client.chat.completions.create(model="m", messages=MEMO_MESSAGES, tools=TOOLS, temperature=0, stop=["write"])
    (record,) = proxy.call_log.for_rollout("stop")
    assert resp.choices[0].message.content == "I will " and resp.choices[0].finish_reason == "stop"
    assert proxy.tokenizer.decode(record.output_ids).endswith("write")


@pytest.mark.integration
def test_bad_inputs_get_openai_errors(proxy):
    client = client_for(proxy.url)
    calls_before = len(proxy.call_log)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="m", messages=msgs, extra_body={"frobnicate": True})
    assert info.value.body["param"] == "frobnicate" and "frobnicate" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=msgs, n=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    status, body = post_raw(f"{proxy.url}/v1/chat/completions", b'{"model": "m", "messages": [')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = post_raw(f"{proxy.url}/v1/nope", b"{}")
    assert status == 404 and "message" in body["error"]
    assert len(proxy.call_log) == calls_before  # nothing reached an engine


@pytest.mark.integration
def test_context_limit_rejects_long_prompts_and_caps_max_tokens(tokenizer, engines):
    prompt_len = len(TitoRenderer(tokenizer, CallLog()).render("x", MEMO_MESSAGES, TOOLS).input_ids)
    with running_proxy(tokenizer, [engines[0].url], max_context_tokens=prompt_len - 1) as small:
        with pytest.raises(openai.BadRequestError) as info:
            client_for(small.url).chat.completions.create(model="m", messages=MEMO_MESSAGES, tools=TOOLS)
        assert info.value.code == "context_length_exceeded"
        assert info.value.response.headers["x-gyre-context-limit"] == f"{prompt_len} > {prompt_len - 1}"
        assert info.value.body["message"] == (
            f"This model's maximum context length is {prompt_len - 1} tokens. "
            f"However, your messages resulted in {prompt_len} tokens."
        )
    with running_proxy(tokenizer, [engines[0].url], max_context_tokens=prompt_len + 5) as fits:
        # Greedy decoding of the memorized prompt would emit 40 tokens: max_tokens is capped to the 5 left.
        resp = client_for(fits.url).chat.completions.create(
            model="m", messages=MEMO_MESSAGES, tools=TOOLS, temperature=0, max_tokens=500
        )
        assert resp.usage.prompt_tokens == prompt_len and resp.usage.completion_tokens == 5
        assert resp.choices[0].finish_reason == "length"


@pytest.mark.integration
def test_a_run_seed_makes_calls_without_a_seed_reproducible(tokenizer, engines):
    """proxy.sampling_seed: Claude Code and Codex send no seed; with it the same rollout's same conversation samples
    the same tokens (temperature 1), another rollout's its own; a seed the call sends still wins."""

    def sample(server, rollout: str, **kw) -> list[int]:
        client = client_for(server.url, default_headers={"X-Rollout-Id": rollout})
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Write the value 4"}],
                                       max_tokens=24, temperature=1.0, **kw)  # fmt: skip
        return server.call_log.for_rollout(rollout)[-1].output_ids

    with running_proxy(tokenizer, [engines[0].url], sampling_seed=7) as seeded:
        first, again, other = sample(seeded, "a"), sample(seeded, "a"), sample(seeded, "b")
        assert first == again and first != other
        assert sample(seeded, "a", seed=11) == sample(seeded, "c", seed=11)  # the call's own seed decides
    with running_proxy(tokenizer, [engines[0].url], sampling_seed=7) as rerun:  # a rerun of the run samples the same
        assert sample(rerun, "a") == first and sample(rerun, "b") == other


@pytest.mark.integration
def test_engine_down_gives_503_and_the_proxy_recovers(tokenizer, engines):
    dead = f"http://127.0.0.1:{free_port()}"
    msgs = [{"role": "user", "content": "hi"}]
    with running_proxy(tokenizer, [dead]) as server:
        client = client_for(server.url)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        assert info.value.status_code == 503 and info.value.code == "engine_unavailable"
        server.set_engines([])
        with pytest.raises(openai.InternalServerError):
            client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        server.set_engines([dead, engines[1].url])  # the dead one is tried first, then the live one
        client.chat.completions.create(model="m", messages=msgs, max_tokens=2)
        (record,) = server.call_log.for_rollout("default")
        assert record.engine_url == engines[1].url and server.dispatcher.retries == 1
        # routing around the dead engine is counted (the run's metrics report it; the controller declares an
        # engine failing call after call dead)
        d = server.dispatcher
        assert d.engine_failures == {dead: 2} and d.routed_around == 2 and d.failing_since_success == {dead: 2}
        with urllib.request.urlopen(f"{server.url}/health") as resp:
            assert json.loads(resp.read())["status"] == "ok"


@pytest.mark.integration
def test_aborted_call_is_retried_on_another_engine(tokenizer, engines):
    a, b = engines

    async def engine_call(url: str, method: str, *args):
        client = EngineClient(url)
        try:
            return await getattr(client, method)(*args)
        finally:
            await client.close()

    with running_proxy(tokenizer, [a.url, b.url]) as server:
        asyncio.run(engine_call(a.url, "_request", "POST", "/pause_generation", {"mode": "in_place"}))
        try:
            result: dict = {}
            worker = threading.Thread(
                target=lambda: result.update(
                    resp=client_for(server.url).chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=3
                    )
                )
            )
            worker.start()
            deadline = time.monotonic() + 30
            while asyncio.run(engine_call(a.url, "server_info"))["num_queued_reqs"] == 0:
                assert time.monotonic() < deadline, "the request never reached engine A"
                time.sleep(0.05)
            asyncio.run(engine_call(a.url, "abort", f"gyre-{server.dispatcher.tag}-"))
            worker.join(30)
        finally:
            asyncio.run(engine_call(a.url, "continue_generation"))
        assert "resp" in result
        (record,) = server.call_log.for_rollout("default")
        assert record.engine_url == b.url and server.dispatcher.retries == 1
        assert len(record.output_ids) == result["resp"].usage.completion_tokens


@pytest.mark.integration
def test_built_in_harness_threads_get_roles_and_branch_the_tree(proxy):
    """The built-in harness's signals (gyre/harness/builtin.py) as the proxy sees them: a retried request, a
    summary request and a sub-agent's request (X-Agent-Id) are labelled main, main_summary and subagent, and
    the rollout's tree branches where their prompts part (path tokens per tree token > 1)."""
    from gyre.harness.builtin import AGENT_ID_HEADER, SUMMARY_PROMPT
    from gyre.traj.build import build_tree

    client = client_for(f"{proxy.url}/rollout/threads")
    sub = client_for(f"{proxy.url}/rollout/threads", default_headers={AGENT_ID_HEADER: "a0123456789abcdef"})
    ask = dict(model="m", tools=TOOLS, temperature=1.0, max_tokens=8)
    client.chat.completions.create(messages=MEMO_MESSAGES, **ask)
    client.chat.completions.create(messages=MEMO_MESSAGES, **ask)  # the same request again: a retried reply
    client.chat.completions.create(messages=[*MEMO_MESSAGES, {"role": "user", "content": SUMMARY_PROMPT}], **ask)
    sub.chat.completions.create(messages=[MEMO_MESSAGES[0], {"role": "user", "content": "Write 4 into b.txt"}], **ask)
    records = proxy.call_log.for_rollout("threads")
    assert [r.role for r in records] == ["main", "main", "main_summary", "subagent"]
    tree = build_tree("threads", records)
    path_tokens = sum(int(tree.depth[leaf]) + 1 for leaf in tree.leaves())
    # 3 leaves at least: the summary and the sub-agent part from the main thread (a retry that samples the same
    # reply shares its leaf; the memorised model mostly does)
    assert len(tree.leaves()) >= 3 and path_tokens > tree.n_tokens
    assert {c.role for c in tree.calls} == {"main", "main_summary", "subagent"}
