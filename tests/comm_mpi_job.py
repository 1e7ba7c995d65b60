"""The MPI programs behind tests/test_comm.py: `mpirun -n N python -m mpi4py tests/comm_mpi_job.py SCENARIO OUT`
(`-m mpi4py`: a rank that raises aborts the whole job rather than leaving the others waiting).

Scenarios (each writes its findings as JSON to OUT for the test to check):
- control (4 ranks, cells [1, 2]): role switches with acks, step start/end around a 2 s idle
  (CPU time of the idle ranks), micro-batch assignment, an error travelling back in an ack.
- weights (3 ranks, cells [1, 1]): the core publishes versions of the tiny model's state dict; the
  satellite pulls them through Mooncake and through gloo; a stale handle is refused.
- kv (2 ranks, no controller): engine A pauses an in-flight request and exports its KV; engine B
  pulls A's weights and the KV through Mooncake, imports it and continues the request.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

from gyre.comm.control import ControlError, world_control_plane
from gyre.comm.messages import MicroBatchAssignment, RoleSwitch, StepEnd, StepStart, WeightVersion
from gyre.config.schema import ModelConfig
from gyre.model.llama import LlamaForCausalLM

TINY = ModelConfig(
    vocab_size=300, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128
)


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(TINY)


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().contiguous()
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----- control -----
def control(out: Path) -> None:
    cp = world_control_plane([1, 2])
    if cp.is_controller:
        results: dict[str, Any] = {"switches": []}
        for cell, role in [(0, "train"), (1, "train"), (1, "rollout"), (0, "rollout")]:
            res = cp.switch_role(cell, role)
            results["switches"].append(
                {"cell": cell, "role": role, "latency_s": res.latency_s, "acks": [a.detail for a in res.acks]}
            )
        cp.request(cp.layout.workers, StepStart(1, "v0"))
        time.sleep(2.0)
        results["idle"] = [a.detail for a in cp.request(cp.layout.workers, StepEnd(1, "v1"))]
        results["micro_batches"] = cp.request([1], MicroBatchAssignment(1, (3, 4, 5)))[0].detail
        try:
            cp.request([2], WeightVersion("v9"))
        except ControlError as e:
            results["error"] = str(e)
        cp.shutdown("done")
        out.write_text(json.dumps(results))
    else:
        marks: dict[str, float] = {}

        def on_switch(msg: RoleSwitch) -> dict[str, Any]:
            cp.cell_barrier(timeout=30)  # the whole cell switches together
            return {"rank": cp.rank, "cell": cp.cell, "role": msg.role, "cell_size": cp.cell_comm.Get_size()}

        def on_start(msg: StepStart) -> None:
            marks["wall"], marks["cpu"] = time.monotonic(), time.process_time()

        def on_end(msg: StepEnd) -> dict[str, float]:
            wall = time.monotonic() - marks["wall"]
            return {
                "rank": cp.rank,
                "idle_wall_s": wall,
                "idle_cpu_fraction": (time.process_time() - marks["cpu"]) / wall,
            }

        def on_weights(msg: WeightVersion) -> None:
            raise ValueError(f"rank {cp.rank} holds no weights for {msg.version}")

        cp.serve(
            {
                RoleSwitch: on_switch,
                StepStart: on_start,
                StepEnd: on_end,
                MicroBatchAssignment: lambda m: {"micro_batches": list(m.micro_batches)},
                WeightVersion: on_weights,
            },
            timeout=120,
        )
    cp.close()


# ----- weights -----
def weights(out: Path) -> None:
    from gyre.comm.gloo_transport import GlooTransport, init_gloo_from_mpi
    from gyre.comm.mooncake_transport import MooncakeTransport
    from gyre.comm.transfer import WeightTransport

    init_gloo_from_mpi(MPI.COMM_WORLD)
    cp = world_control_plane([1, 1])
    core, satellite = cp.layout.ranks(0)[0], cp.layout.ranks(1)[0]
    transports = {"gloo": GlooTransport()}
    if not cp.is_controller:
        transports["mooncake"] = MooncakeTransport(owner_rank=cp.rank)
    if cp.is_controller:
        results: dict[str, Any] = {"pulls": []}
        handles: dict[str, Any] = {}
        for step in (1, 2):
            detail = cp.request([core], StepEnd(step, f"v{step}"))[0].detail
            handles[f"v{step}"] = detail["handles"]
            for name, handle in detail["handles"].items():
                peers = [satellite] if name == "mooncake" else [core, satellite]
                acks = {a.rank: a.detail for a in cp.request(peers, WeightVersion(handle.version, handle))}
                results["pulls"].append({"transport": name, "published": detail["digest"], **acks[satellite]})
        cp.request([core], StepEnd(3, "v3"))  # v3 overwrites the buffer v1 was in (two per key)
        try:
            cp.request([satellite], WeightVersion("v1", handles["v1"]["mooncake"]))
        except ControlError as e:
            results["stale_error"] = str(e)
        ack = cp.request([satellite], WeightVersion("v2", handles["v2"]["mooncake"]))[0].detail
        results["v2_after_v3"] = ack["version"]
        cp.shutdown()
        out.write_text(json.dumps(results))
    else:
        model = tiny_model(seed=99)

        def on_step_end(msg: StepEnd) -> dict[str, Any]:
            state = tiny_model(seed=msg.step).state_dict()
            handles = {name: WeightTransport(t).publish(state, msg.weight_version) for name, t in transports.items()}
            return {"handles": handles, "digest": digest(state)}

        def on_weights(msg: WeightVersion) -> dict[str, Any]:
            handle = msg.handle
            transport = WeightTransport(transports[handle.transport])
            if handle.owner_rank == cp.rank:
                transport.serve(handle, [satellite])
                return {}
            start = time.monotonic()
            pulled = transport.pull(handle)
            seconds = time.monotonic() - start
            model.load_state_dict(pulled.state, strict=True)
            return {"version": pulled.version, "digest": digest(model.state_dict()), "seconds": seconds}

        cp.serve({StepEnd: on_step_end, WeightVersion: on_weights}, timeout=120)
    cp.close()
    for t in transports.values():
        t.close()
    torch.distributed.destroy_process_group()


# ----- kv -----
def kv(out: Path) -> None:
    from gyre.comm.mooncake_transport import MooncakeTransport
    from gyre.comm.transfer import KVTransport, WeightTransport
    from gyre.engine.batcher import Batcher, BatcherConfig, Delta, Sequence
    from gyre.engine.kv_cache import SlotKVCache, decode_slots
    from gyre.engine.kv_session import export_session_kv, import_session_kv, write_slot_kv
    from gyre.engine.sampling import SamplingSpec

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    transport = MooncakeTransport(owner_rank=rank)
    max_new = 40

    def generate(batcher: Batcher, rid: str, prompt: list[int], n: int) -> tuple[list[Delta], Sequence]:
        deltas: list[Delta] = []
        seq = Sequence(rid, prompt, SamplingSpec(max_new_tokens=n, temperature=0.0), False, deltas.append)
        batcher.call(batcher.submit, seq).result()
        return deltas, seq

    def wait(predicate: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not reach the expected state")
            time.sleep(0.005)

    if rank == 0:  # engine A: the source
        model = tiny_model(seed=0)
        comm.send(WeightTransport(transport).publish(model.state_dict(), "v1"), dest=1)
        batcher = Batcher(model, BatcherConfig(max_context_tokens=512), weight_version="v1")
        batcher.start()
        prompt = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
        deltas, seq = generate(batcher, "s1", prompt, max_new)
        wait(lambda: len(seq.output_ids) >= 8)
        batcher.call(batcher.pause, "in_place").result()
        session, tokens = batcher.call(lambda: (export_session_kv(batcher, "s1"), seq.tokens())).result()
        handle = KVTransport(transport).publish(session)
        comm.send((handle, tokens, len(seq.output_ids), digest({"k": session.k, "v": session.v})), dest=1)
        batcher.call(batcher.resume).result()
        wait(lambda: deltas and deltas[-1].finish is not None)
        comm.send((seq.output_ids, seq.output_logprobs), dest=1)
        comm.recv(source=1)  # B has pulled: the buffers may go
        batcher.stop()
    else:  # engine B: the target
        model = tiny_model(seed=1)
        pulled = WeightTransport(transport).pull(comm.recv(source=0))
        model.load_state_dict(pulled.state, strict=True)
        batcher = Batcher(model, BatcherConfig(max_context_tokens=512), weight_version=pulled.version)
        batcher.start()
        handle, tokens, n_out, sent_digest = comm.recv(source=0)
        session = KVTransport(transport).pull(handle)
        imported = batcher.call(import_session_kv, batcher, session).result()
        deltas, migrated = generate(batcher, "s1", tokens, max_new - n_out)
        wait(lambda: deltas and deltas[-1].finish is not None)
        batcher.call(batcher.flush_cache).result()
        fresh_deltas, fresh = generate(batcher, "s1-recompute", tokens, max_new - n_out)
        wait(lambda: fresh_deltas and fresh_deltas[-1].finish is not None)
        a_ids, a_logprobs = comm.recv(source=0)
        comm.send("pulled", dest=0)
        batcher.stop()
        with torch.no_grad():  # the whole sequence in one forward: what recomputing the prefix gives
            full = tokens + migrated.output_ids
            logits, _ = model(torch.tensor(full[:-1])[None], torch.arange(len(full) - 1)[None])
            forward = torch.log_softmax(logits[0], -1).gather(1, torch.tensor(full[1:])[:, None])[:, 0]
            cache = SlotKVCache(model, max_slots=4, max_len=512)
            write_slot_kv(cache, 0, session)
            cache.ensure(1, len(tokens))
            slot_logits = decode_slots(model, cache, torch.tensor([tokens[-1]]), torch.tensor([len(tokens) - 1]))
            slot_lp = torch.log_softmax(slot_logits[0], -1)
            forward_lp = torch.log_softmax(logits[0, len(tokens) - 1], -1)
        n_new = len(migrated.output_ids)
        result = {
            "weights_version": pulled.version,
            "kv_version": session.meta.weight_version,
            "kv_digest_sent": sent_digest,
            "kv_digest_received": digest({"k": session.k, "v": session.v}),
            "kv_tokens": len(session.meta.token_ids),
            "imported_tokens": imported,
            "prompt_tokens": len(tokens),
            "migrated_cached_tokens": deltas[-1].cached_tokens,
            "recompute_cached_tokens": fresh_deltas[-1].cached_tokens,
            "migrated_ids": migrated.output_ids,
            "recompute_ids": fresh.output_ids,
            "source_ids": a_ids[n_out:],
            "max_diff_vs_recompute": (torch.tensor(migrated.output_logprobs) - torch.tensor(fresh.output_logprobs))
            .abs()
            .max()
            .item(),
            "max_diff_vs_source": (torch.tensor(migrated.output_logprobs) - torch.tensor(a_logprobs[n_out:]))
            .abs()
            .max()
            .item(),
            "max_diff_vs_forward": (torch.tensor(migrated.output_logprobs) - forward[-n_new:]).abs().max().item(),
            "slot_max_diff_vs_forward": (slot_lp - forward_lp).abs().max().item(),
        }
        out.write_text(json.dumps(result))
    comm.Barrier()
    transport.close()


if __name__ == "__main__":
    torch.set_num_threads(1)
    scenario, out_path = sys.argv[1], Path(sys.argv[2])
    {"control": control, "weights": weights, "kv": kv}[scenario](out_path)
