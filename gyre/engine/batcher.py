"""The continuous-batching loop of the embedded engine, in its own thread.

Every step: run the control commands that arrived (submit, abort, pause, weight update, ...), prefill
newly admitted requests (reusing the longest cached prefix), then decode one token for every running
request in one batched forward. Only this thread touches the model and the caches; other threads
talk to it through `call`, whose closures run between steps, and receive tokens through each
request's `sink` (the server's `loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import logging
import random
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import Empty, SimpleQueue
from typing import IO, Any

import torch
from safetensors.torch import load, save

from gyre.engine.kv_cache import SlotKVCache, decode_slots, prefill_slot
from gyre.engine.prefix_cache import PrefixCache
from gyre.engine.sampling import BatchSamplingParams, SamplingSpec, sample_tokens
from gyre.model.llama import LlamaForCausalLM, SparseMoE

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")
MEMORY_TAGS = ("weights", "kv_cache")


@dataclass
class BatcherConfig:
    max_running_requests: int = 64
    max_context_tokens: int = 4096
    prefix_cache_tokens: int = 32768
    prefill_chunk_tokens: int = 512


@dataclass
class Delta:
    """What a request gained since its last delta; `finish` is set on the last one."""

    output_ids: list[int]
    logprobs: list[float]  # tempered (gyre.engine.sampling)
    weight_version: str
    cached_tokens: int = 0
    finish: dict[str, Any] | None = None
    weight_versions: list[dict[str, Any]] | None = None
    truncated_logprobs: list[float] = field(default_factory=list)  # over the kept set, one per output id
    routed_experts: bytes = b""  # at the finish, when asked: int32 [kv_len - routed_from, MoE layers, top-k]


@dataclass(eq=False)
class Sequence:
    """One generation request and its progress; owned by the batcher thread once submitted."""

    rid: str
    prompt: list[int]
    spec: SamplingSpec
    stream: bool
    sink: Callable[[Delta], None]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_truncated_logprobs: list[float] = field(default_factory=list)
    kv_len: int = 0  # tokens whose keys/values sit in the slot
    kv_epoch: int = 0  # the batcher's weights epoch when this KV was started
    slot: int = -1
    cached_tokens: int = -1  # -1 until first admitted
    emitted: int = 0  # tokens already sent through sink
    finish: dict[str, Any] | None = None
    version_events: list[tuple[str, int]] = field(default_factory=list)
    stop_ids: frozenset[int] = frozenset()
    rng: random.Random = field(default_factory=random.Random)
    # the first position whose routed experts are returned (SGLang's routed_experts_start_len); -1: none asked
    routed_from: int = -1
    routed: list[torch.Tensor] = field(default_factory=list)  # [n, MoE layers, top-k] per forward, in order

    def tokens(self) -> list[int]:
        return self.prompt + self.output_ids


def weight_version_spans(events: list[tuple[str, int]], current: str, n_out: int) -> list[dict[str, Any]]:
    """Which weight version produced which output tokens, as SGLang's `meta_info.weight_versions`."""
    spans: list[dict[str, Any]] = []
    for version, end in [*events, (current, n_out)]:
        end = min(end, n_out)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class Batcher:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: BatcherConfig,
        eos_ids: frozenset[int] = frozenset(),
        weight_version: str = "default",
        decode_text: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.model = model.eval()
        self.config = config
        self.vocab_size = model.cfg.vocab_size
        self.eos_ids = eos_ids
        self.weight_version = weight_version
        self.decode_text = decode_text
        self.cache = SlotKVCache(model, config.max_running_requests, config.max_context_tokens)
        self.prefix = PrefixCache(config.prefix_cache_tokens)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused = False
        self.released: set[str] = set()
        self.steps = 0
        self.weights_epoch = 0  # bumped when new weights invalidate cached keys/values
        self.generated_tokens = 0
        self.last_step_time = 0.0
        self._params: BatchSamplingParams | None = None
        self._stash: IO[bytes] | None = None
        self._commands: SimpleQueue[tuple[Callable[[], Any], Future]] = SimpleQueue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gyre-batcher", daemon=True)

    # ----- thread plumbing -----
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) in the batcher thread between steps; the future carries its result."""
        fut: Future = Future()
        self._commands.put((lambda: fn(*args), fut))
        return fut

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
        except Empty:
            return
        while True:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:  # noqa: BLE001 - handed to the caller through the future
                    fut.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except Empty:
                return

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stopping.is_set():
                can_work = not self.paused and not self.released
                self._run_commands(block=not (can_work and (self.running or self.waiting)))
                if self.paused or self.released:
                    continue
                try:
                    self._admit()
                    if self.running:
                        self._decode()
                except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                    log.error("engine step failed:\n%s", traceback.format_exc())
                    self._fail_all(f"engine step failed: {e!r}")

    # ----- scheduling -----
    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_running_requests:
            seq = self.waiting.popleft()
            try:
                self._prefill(seq)
            except Exception:
                if seq not in self.running:
                    self.waiting.appendleft(seq)  # so that _fail_all answers it
                raise

    def _prefill(self, seq: Sequence) -> None:
        tokens = torch.tensor(seq.tokens(), dtype=torch.long)
        n = tokens.shape[0]
        # a request that wants its tokens' routed experts runs its whole prompt (a cached prefix has no routing)
        cached, k, v = self.prefix.match(tokens, limit=n - 1) if seq.routed_from < 0 else (0, None, None)
        seq.routed.clear()
        slot = len(self.running)
        self.cache.ensure(slot + 1, n)
        if cached:
            self.cache.load(slot, k, v)
        chunk = self.config.prefill_chunk_tokens
        logits = None
        for start in range(cached, n, chunk):
            logits = prefill_slot(self.model, self.cache, slot, tokens[start : start + chunk], start)
            if seq.routed_from >= 0:
                seq.routed.append(self._routed_rows()[0])
        if seq.cached_tokens < 0:
            seq.cached_tokens = cached
        seq.kv_len, seq.slot, seq.kv_epoch = n, slot, self.weights_epoch
        self._remember(seq)  # requests admitted next (a group of samples of one prompt) reuse it at once
        self.running.append(seq)
        self._params = None
        if len(seq.output_ids) >= seq.spec.max_new_tokens:
            seq.finish = {"type": "length", "length": seq.spec.max_new_tokens}
        else:
            self._sample_and_append([seq], logits[None])
        self._retire_finished()

    def _decode(self) -> None:
        lengths = torch.tensor([s.kv_len for s in self.running])
        last = torch.tensor([s.output_ids[-1] for s in self.running])
        self.cache.ensure(len(self.running), int(lengths.max()) + 1)
        logits = decode_slots(self.model, self.cache, last, lengths)
        if any(s.routed_from >= 0 for s in self.running):
            rows = self._routed_rows()  # [B, 1, L, k]
            for i, s in enumerate(self.running):
                if s.routed_from >= 0:
                    s.routed.append(rows[i])
        for s in self.running:
            s.kv_len += 1
        self._sample_and_append(self.running, logits)
        self.steps += 1
        self.last_step_time = time.time()
        self._retire_finished()

    def _routed_rows(self) -> torch.Tensor:
        """The last forward's routed experts [B, T, MoE layers, top-k] (gyre/model/llama.py SparseMoE.routed)."""
        moe = [layer.mlp.routed for layer in self.model.model.layers if isinstance(layer.mlp, SparseMoE)]
        if not moe:
            raise ValueError("return_routed_experts asks for routed experts; this model has no MoE layers")
        return torch.stack(moe, dim=2).cpu()

    def _sample_and_append(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        if seqs is self.running:
            if self._params is None:
                self._params = BatchSamplingParams.build([s.spec for s in seqs], self.vocab_size, logits.device)
            params = self._params
        else:
            params = BatchSamplingParams.build([s.spec for s in seqs], self.vocab_size, logits.device)
        uniforms = None
        if not params.all_greedy:
            uniforms = torch.tensor([s.rng.random() for s in seqs], device=logits.device)
        banned = None
        if any(len(s.output_ids) < s.spec.min_new_tokens and s.stop_ids for s in seqs):
            banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            for i, s in enumerate(seqs):
                if len(s.output_ids) < s.spec.min_new_tokens and s.stop_ids:
                    banned[i, list(s.stop_ids)] = True
        out = sample_tokens(logits, params, uniforms, banned)
        rows = zip(seqs, out.tokens.tolist(), out.logprobs.tolist(), out.truncated_logprobs.tolist(), strict=True)
        for s, tok, lp, truncated_lp in rows:
            self._append(s, tok, lp, truncated_lp)

    def _append(self, seq: Sequence, token: int, logprob: float, truncated_logprob: float) -> None:
        seq.output_ids.append(token)
        seq.output_logprobs.append(logprob)
        seq.output_truncated_logprobs.append(truncated_logprob)
        self.generated_tokens += 1
        spec, n_out = seq.spec, len(seq.output_ids)
        if token in seq.stop_ids and n_out > spec.min_new_tokens:
            seq.finish = {"type": "stop", "matched": token}
        elif spec.stop and self.decode_text is not None and (hit := self._stop_string(seq)) is not None:
            seq.finish = {"type": "stop", "matched": hit}
        elif n_out >= spec.max_new_tokens:
            seq.finish = {"type": "length", "length": spec.max_new_tokens}
        elif seq.kv_len + 1 > self.config.max_context_tokens:  # no room to feed this token back
            seq.finish = {"type": "length", "length": n_out}
        if seq.stream and seq.finish is None:
            self._emit(seq)

    def _stop_string(self, seq: Sequence) -> str | None:
        text = self.decode_text(seq.output_ids)
        return next((s for s in seq.spec.stop if s in text), None)

    def _retire_finished(self) -> None:
        if not any(s.finish is not None for s in self.running):
            return
        finished = [s for s in self.running if s.finish is not None]
        for s in finished:
            self._remember(s)  # before compaction overwrites their slots
        keep = len(self.running) - len(finished)
        holes = [i for i, s in enumerate(self.running[:keep]) if s.finish is not None]
        movers = [s for s in self.running[keep:] if s.finish is None]
        survivors = self.running[:keep]
        for hole, s in zip(holes, movers, strict=True):
            self.cache.move(s.slot, hole, s.kv_len)
            s.slot = hole
            survivors[hole] = s
        self.running = survivors
        self._params = None
        for s in finished:  # last, so whoever wakes up sees them gone from `running`
            self._emit(s)

    def _remember(self, seq: Sequence) -> None:
        """Keep a sequence's keys/values for later prompts that extend it."""
        # KV begun under older weights mixes versions: caching it would serve stale prefixes.
        if seq.kv_len > 0 and seq.kv_epoch == self.weights_epoch and "kv_cache" not in self.released:
            k, v = self.cache.read(seq.slot, seq.kv_len)
            self.prefix.insert(torch.tensor(seq.tokens()[: seq.kv_len]), k, v)

    def _emit(self, seq: Sequence) -> None:
        delta = Delta(
            output_ids=seq.output_ids[seq.emitted :],
            logprobs=seq.output_logprobs[seq.emitted :],
            truncated_logprobs=seq.output_truncated_logprobs[seq.emitted :],
            weight_version=self.weight_version,
            cached_tokens=max(seq.cached_tokens, 0),
        )
        seq.emitted = len(seq.output_ids)
        if seq.finish is not None:
            delta.finish = seq.finish
            if seq.routed_from >= 0:  # positions [routed_from, kv_len): every token the engine ran (SGLang's range)
                rows = torch.cat(seq.routed)[seq.routed_from : seq.kv_len]
                delta.routed_experts = rows.to(torch.int32).numpy().tobytes()
            delta.weight_versions = weight_version_spans(seq.version_events, self.weight_version, len(seq.output_ids))
        try:
            seq.sink(delta)
        except RuntimeError:  # the server's event loop is gone (shutdown); nobody is listening
            pass

    def _finish_now(self, seqs: list[Sequence], finish: dict[str, Any]) -> None:
        """Finish running or waiting sequences outside a step (abort, failure)."""
        for s in seqs:
            s.finish = dict(finish)
            if s in self.waiting:
                self.waiting.remove(s)
                self._emit(s)
        self._retire_finished()

    def _fail_all(self, message: str) -> None:
        seqs = list(self.running) + list(self.waiting)
        for s in seqs:
            s.finish = {"type": "abort", "message": message, "status_code": 500, "err_type": "InternalServerError"}
        self.waiting.clear()
        for s in seqs:
            self._emit(s)
        self.running = []
        self._params = None
        self.cache.free()

    # ----- commands (run in the batcher thread through `call`) -----
    def submit(self, seq: Sequence) -> None:
        seq.stop_ids = frozenset(seq.spec.stop_token_ids) | (frozenset() if seq.spec.ignore_eos else self.eos_ids)
        if seq.spec.sampling_seed is not None:
            seq.rng = random.Random(seq.spec.sampling_seed)
        self.waiting.append(seq)

    def abort(
        self, rid: str = "", abort_all: bool = False, message: str = "Aborted by request", exact: bool = False
    ) -> int:
        """Finish matching requests with their partial output; like SGLang, rid matches as a prefix
        (so "x" aborts a batch "x_0", "x_1") unless `exact`."""
        if not abort_all and not rid:
            return 0
        hit = [
            s
            for s in [*self.running, *self.waiting]
            if abort_all or s.rid == rid or (not exact and s.rid.startswith(rid))
        ]
        self._finish_now(hit, {"type": "abort", "message": message, "status_code": None, "err_type": None})
        return len(hit)

    def pause(self, mode: str) -> int:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.paused = True
        if mode == "abort":
            return self.abort(abort_all=True, message="Aborted by pause_generation")
        if mode == "retract":
            for s in reversed(self.running):
                self._remember(s)
                s.kv_len, s.slot = 0, -1
                self.waiting.appendleft(s)
            self.running = []
            self._params = None
        return len(self.running) + len(self.waiting)

    def resume(self) -> None:
        self.paused = False

    def update_weights(
        self, state: dict[str, torch.Tensor], version: str | None, flush_cache: bool, abort_all: bool
    ) -> int:
        """Swap in new weights; running requests continue with them (their version spans record it)."""
        if "weights" in self.released:
            raise ValueError("weights are released; call /resume_memory_occupation before updating them")
        if abort_all:
            self.abort(abort_all=True, message="Aborted by update_weights_from_disk")
        self.model.load_state_dict(state, strict=True)
        if version is not None:
            self.set_weight_version(version)
        if flush_cache:
            self.prefix.clear()
            self.weights_epoch += 1
        return len(self.running) + len(self.waiting)

    def set_weight_version(self, version: str) -> None:
        if version != self.weight_version:
            for s in self.running:
                if s.output_ids:
                    s.version_events.append((self.weight_version, len(s.output_ids)))
        self.weight_version = version

    def flush_cache(self) -> None:
        self.prefix.clear()
        if not self.running:
            self.cache.free()

    def release_memory(self, tags: list[str] | None) -> None:
        tags = list(tags or MEMORY_TAGS)
        if bad := sorted(set(tags) - set(MEMORY_TAGS)):
            raise ValueError(f"unknown memory tags {bad}; use {list(MEMORY_TAGS)}")
        if self.running:
            raise ValueError(
                f"{len(self.running)} requests are running; pause_generation with mode 'retract' or 'abort' first"
            )
        if "kv_cache" in tags:
            self.cache.free()
            self.prefix.clear()
            self.released.add("kv_cache")
        if "weights" in tags and "weights" not in self.released:
            # named_parameters lists tied weights once (safetensors refuses shared tensors); resume restores both
            params = {k: p.detach().cpu().contiguous() for k, p in self.model.named_parameters()}
            # an unnamed file (unlinked at creation): the kernel frees it when the engine exits, even by SIGKILL
            self._stash = tempfile.TemporaryFile(prefix="gyre-engine-weights-")
            self._stash.write(save(params))
            del params
            for p in self.model.parameters():
                p.data = torch.empty(0, device=p.device, dtype=p.dtype)
            self.released.add("weights")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, as SGLang's memory saver does

    def resume_memory(self, tags: list[str] | None) -> None:
        tags = list(tags or MEMORY_TAGS)
        if bad := sorted(set(tags) - set(MEMORY_TAGS)):
            raise ValueError(f"unknown memory tags {bad}; use {list(MEMORY_TAGS)}")
        if "weights" in tags and "weights" in self.released and self._stash is not None:
            self._stash.seek(0)
            state = load(self._stash.read())
            params = dict(self.model.named_parameters())
            for name, tensor in state.items():
                params[name].data = tensor.to(params[name].device)
            self._stash.close()
            self._stash = None
        self.released -= set(tags)

    def stats(self) -> dict[str, Any]:
        return {
            "num_running_reqs": len(self.running),
            "num_queued_reqs": len(self.waiting),
            "paused": self.paused,
            "memory_released": sorted(self.released),
            "weight_version": self.weight_version,
            "decode_steps": self.steps,
            "generated_tokens": self.generated_tokens,
            "kv_cache": {"slots": self.cache.slots, "capacity_tokens": self.cache.capacity, "bytes": self.cache.nbytes},
            "prefix_cache": self.prefix.stats(),
        }
