"""The prepared GPU check: one script, one GPU machine, figures in one JSON file, well inside 10 minutes.

On a GPU machine with no network (Python 3.12, CUDA torch, transformers, triton, h5py, mpi4py):

    python tools/gpu_check.py --out gpu_check.json                  # embedded engine on CUDA
    python tools/gpu_check.py --engine sglang --out gpu_check.json  # a cluster node with SGLang installed

It installs gyre (`pip install --no-deps -e .`) and, from ./wheels, any of megatron-core and
aiohttp's family that the machine lacks. Fill ./wheels (gitignored) on a machine with network first:

    python tools/gpu_check.py --prepare-wheels

Then it builds a random-weights Qwen3-0.6B-shaped model and measures, side by side in one run:
generation throughput through the proxy (and straight to the engine), role-switch latency both
ways (pause + release memory; resume memory + weight load + continue), weight sync time (trainer
export, checkpoint write, engine load; SGLang also from tensor and over a broadcast group in flattened
buckets), a prefix written by one SGLang server to a Mooncake store through HiCache and loaded by another
(prefill tokens counted), tree-packed vs expanded forward-backward time, tree-vs-path logprob agreement, and one cell's
rollout -> train -> rollout cycle through launch.run (docs/gpu.md lists the figures). A section that fails records its error
and the others still run; the exit code is 1 if any failed. `--tiny` runs everything on CPU with a
tiny Qwen3 (the CI exercise of this script).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "wheels"
MEGATRON_CORE = "megatron-core==0.16.1"
# Distributions gyre needs beyond the GPU machine's stack (CUDA torch, transformers -> tokenizers,
# safetensors, numpy): megatron-core and aiohttp with its dependencies, all small.
WHEEL_SPECS = [MEGATRON_CORE, "aiohttp", "aiohappyeyeballs", "aiosignal", "attrs", "frozenlist", "multidict",
               "propcache", "yarl", "idna", "typing_extensions", "setuptools"]  # fmt: skip
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ----- installation -----


def prepare_wheels(python_version: str = "3.12") -> None:
    """Download the wheels the offline GPU machine installs from (run where there is network)."""
    WHEELS.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
           "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64", "-d", str(WHEELS), *WHEEL_SPECS]  # fmt: skip
    subprocess.run(cmd, check=True)
    size = sum(f.stat().st_size for f in WHEELS.glob("*.whl")) / 2**20
    print(f"gpu_check: {len(list(WHEELS.glob('*.whl')))} wheels, {size:.1f} MiB in {WHEELS}")


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def ensure_installed(log: Callable[[str], None]) -> list[str]:
    """gyre editable, no deps; then each wheel in ./wheels whose distribution is missing. Returns installed names."""
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q"]
    done = []
    for wheel in sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []:
        dist = wheel.name.split("-")[0]
        if not _installed(dist) and not _installed(dist.replace("_", "-")):
            subprocess.run([*pip, str(wheel)], check=True)
            done.append(dist)
    if not _installed("gyre"):
        # setuptools (from ./wheels if absent) builds the editable install without network
        proc = subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT)], capture_output=True, text=True)
        if proc.returncode == 0:
            done.append("gyre")
        else:  # the engine subprocesses still find gyre through PYTHONPATH
            log(f"pip install -e . failed, using PYTHONPATH instead: {proc.stderr.strip()[-500:]}")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()
    missing = [m for m in ("megatron.core", "aiohttp") if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise RuntimeError(
            f"{missing} are not installed and ./wheels has no wheel for them: run `python tools/gpu_check.py "
            "--prepare-wheels` on a machine with network and bring the wheels/ directory along"
        )
    log(f"installed: {done or 'nothing (all present)'}")
    return done


# ----- plan -----


@dataclass
class Plan:
    tiny: bool
    engine: str = "embedded"
    device: str = "cuda"
    shape: str = "qwen3-0.6b"
    engine_dtype: str = "bfloat16"
    requests: int = 64  # concurrent chat completions through the proxy
    max_tokens: int = 128
    prompt_words: int = 200
    switch_repeats: int = 3
    tree_scale: int = 40  # synthetic rollout token counts divided by this (tools/bench_tree_training.py)
    tree_calls: int = 100
    tree_budget: int = 8192  # tokens per micro-batch
    fwd_bwd_repeats: int = 3
    agreement_paths: int = 4

    @classmethod
    def for_run(cls, tiny: bool, engine: str) -> Plan:
        if not tiny:
            return cls(tiny=False, engine=engine)
        return cls(tiny=True, engine=engine, device="cpu", shape="qwen3-tiny", engine_dtype="float32", requests=4,
                   max_tokens=8, prompt_words=20, switch_repeats=1, tree_scale=200, tree_calls=6, tree_budget=4096,
                   fwd_bwd_repeats=1, agreement_paths=2)  # fmt: skip


@dataclass
class Report:
    figures: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def section(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        try:
            self.figures[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded; the other sections still run
            self.errors[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(f"gpu_check: {name} FAILED: {e}", file=sys.stderr, flush=True)
        self.seconds[name] = round(time.perf_counter() - t0, 2)
        print(f"gpu_check: {name} done in {self.seconds[name]:.1f}s", flush=True)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_free_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return round(free / 2**30, 2)


# ----- sections -----


def environment(plan: Plan) -> dict[str, Any]:
    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__, "plan": asdict(plan)}
    for dist in ("megatron-core", "transformers", "triton", "sglang", "transformer-engine"):
        out[dist] = importlib.metadata.version(dist) if _installed(dist) else None
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return out


def build_model(plan: Plan, workdir: Path) -> tuple[Path, Any]:
    import torch

    from gyre.model.random_model import SHAPES, create_random_model

    cfg = SHAPES[plan.shape]
    device = plan.device if plan.device == "cpu" or torch.cuda.is_available() else "cpu"
    path = create_random_model(workdir / "model", cfg, seed=0, dtype=torch.bfloat16, device=device)
    return path, cfg


def start_engine_process(plan: Plan, model_dir: Path, workdir: Path) -> Any:
    from gyre.config.schema import EngineConfig
    from gyre.engine.launcher import start_engine
    from gyre.engine.sglang_backend import start_sglang_server

    if plan.engine == "sglang":
        cfg = EngineConfig(backend="sglang", mem_fraction_static=0.5, dtype=plan.engine_dtype, startup_timeout_s=600,
                           python=sys.executable, max_running_requests=max(plan.requests, 8))  # fmt: skip
        return start_sglang_server(model_dir, cfg, log_path=workdir / "engine.log")
    extra = ["--device", plan.device, "--dtype", plan.engine_dtype]
    return start_engine(model_dir, num_threads=1 if plan.tiny else 4, max_running_requests=max(plan.requests, 8),
                        max_context_tokens=4096, startup_timeout_s=600, log_path=workdir / "engine.log",
                        extra_args=extra, weights_dirs=[workdir, model_dir])  # fmt: skip


def generation_throughput(plan: Plan, model_dir: Path, engine_url: str) -> dict[str, Any]:
    """Completion tokens per second for `requests` concurrent chat completions, through the proxy and direct."""
    import aiohttp

    from gyre.config.schema import ProxyConfig
    from gyre.engine.client import EngineClient, SamplingParams
    from gyre.model.tokenizer import Tokenizer
    from gyre.proxy.call_log import CallLog
    from gyre.proxy.server import ProxyServer

    tokenizer = Tokenizer.load(model_dir)
    proxy = ProxyServer(tokenizer, [engine_url], ProxyConfig(max_context_tokens=4096, request_timeout_s=600),
                        CallLog(None))  # fmt: skip
    url = proxy.start()
    words = "the quick brown fox jumps over the lazy dog and writes answer.txt".split()

    def prompt(i: int) -> str:
        return " ".join(words[(i + k) % len(words)] for k in range(plan.prompt_words))

    async def through_proxy() -> tuple[int, float]:
        async with aiohttp.ClientSession() as http:

            async def one(i: int) -> int:
                body = {"model": "gyre-policy", "messages": [{"role": "user", "content": f"{i}: {prompt(i)}"}],
                        "max_tokens": plan.max_tokens, "temperature": 1.0}  # fmt: skip
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    data = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"proxy answered {resp.status}: {data}")
                    return int(data["usage"]["completion_tokens"])

            await one(-1)  # warm-up (CUDA kernels, allocator)
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(i) for i in range(plan.requests)))
            return sum(counts), time.perf_counter() - t0

    async def direct() -> tuple[int, float]:
        client = EngineClient(engine_url)
        try:
            params = SamplingParams(temperature=1.0, max_new_tokens=plan.max_tokens)
            ids = [tokenizer.encode(f"{i}: {prompt(i)}") for i in range(plan.requests)]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(client.generate(p, params) for p in ids))
            return sum(len(r.output_ids) for r in results), time.perf_counter() - t0
        finally:
            await client.close()

    try:
        proxy_tokens, proxy_s = asyncio.run(through_proxy())
        direct_tokens, direct_s = asyncio.run(direct())
    finally:
        proxy.stop()
    return {
        "requests": plan.requests,
        "max_tokens": plan.max_tokens,
        "proxy_completion_tokens": proxy_tokens,
        "proxy_s": round(proxy_s, 3),
        "proxy_tokens_per_s": round(proxy_tokens / proxy_s, 1),
        "direct_completion_tokens": direct_tokens,
        "direct_s": round(direct_s, 3),
        "direct_tokens_per_s": round(direct_tokens / direct_s, 1),
        "proxy_overhead": round((proxy_s / max(proxy_tokens, 1)) / (direct_s / max(direct_tokens, 1)), 3),
    }


def make_trainer(plan: Plan, model_cfg: Any, model_dir: Path) -> tuple[Any, dict[str, Any]]:
    import torch

    from gyre.config.schema import TrainConfig
    from gyre.model.hf_io import load_hf_state
    from gyre.train.megatron_trainer import MegatronTrainer

    torch.set_num_threads(1 if plan.tiny else 8)
    info: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        trainer = MegatronTrainer(model_cfg, TrainConfig(distributed_optimizer=True))
    except Exception as e:  # noqa: BLE001 - reported; fall back to torch AdamW so the other figures still come
        info["distributed_optimizer_error"] = f"{type(e).__name__}: {e}"
        trainer = MegatronTrainer(model_cfg, TrainConfig(distributed_optimizer=False))
    _, state = load_hf_state(model_dir)
    trainer.load_hf_state_dict(state)
    synchronize()
    info |= {
        "build_s": round(time.perf_counter() - t0, 2),
        "device": str(trainer.device),
        "optimizer": type(trainer.optimizer).__name__,
        "megatron_optimizer": type(getattr(trainer.optimizer, "optimizer", None)).__name__,
    }

    @dataclass
    class Batch:  # one padded micro-batch: exercises forward, backward, clipping and the optimizer step
        tokens: Any

    gen = torch.Generator().manual_seed(0)
    batch = Batch(torch.randint(0, model_cfg.vocab_size, (2, 64 if plan.tiny else 512), generator=gen))
    t1 = time.perf_counter()
    metrics = trainer.train_step([batch], lambda lp, mb: (-lp.mean(), {"nll": float(-lp.mean().detach())}))
    synchronize()
    if metrics["skipped_step"] or not metrics["grad_norm"] > 0:
        raise RuntimeError(f"the optimizer step did not apply: {metrics}")
    info |= {"train_step_s": round(time.perf_counter() - t1, 3), "grad_norm": round(metrics["grad_norm"], 4)}
    return trainer, info


def weight_sync(plan: Plan, trainer: Any, model_cfg: Any, engine_url: str, workdir: Path) -> dict[str, Any]:
    """Trainer -> engine: export to HF names, write a checkpoint, load it in the engine (and SGLang from tensor)."""
    from gyre.engine.engine import EngineServers
    from gyre.engine.sglang_backend import update_from_tensor
    from gyre.model.hf_io import save_hf_checkpoint

    rows: dict[str, list[float]] = {"export_s": [], "save_s": [], "engine_load_s": [], "tensor_s": []}
    for i in range(plan.switch_repeats):
        synchronize()
        t0 = time.perf_counter()
        state = trainer.hf_state_dict()
        synchronize()
        t1 = time.perf_counter()
        path = save_hf_checkpoint(workdir / "sync", {k: v.cpu() for k, v in state.items()}, model_cfg, None)
        t2 = time.perf_counter()

        servers = EngineServers([engine_url])
        servers.update_weights_from_disk(path, f"sync{i}")
        if plan.engine == "sglang":
            t = time.perf_counter()
            update_from_tensor(servers, state, f"sync{i}t", tp_size=1)
            rows["tensor_s"].append(time.perf_counter() - t)
        rows["export_s"].append(t1 - t0)
        rows["save_s"].append(t2 - t1)
        rows["engine_load_s"].append(time.perf_counter() - t2 - (rows["tensor_s"][-1] if rows["tensor_s"] else 0))
    out = {k: round(median(v), 3) for k, v in rows.items() if v}
    out["checkpoint_gib"] = round(sum(f.stat().st_size for f in path.iterdir()) / 2**30, 3)
    out["total_disk_path_s"] = round(out["export_s"] + out["save_s"] + out["engine_load_s"], 3)
    return out


def distributed_sync(plan: Plan) -> dict[str, Any]:
    """Trainer -> SGLang over a broadcast group: not on one GPU. NCCL refuses a communicator with two ranks on
    one GPU, and the check's trainer shares the engine's; engine.weight_sync=distributed is refused there
    (gyre.engine.sglang_backend.SGLangEngine), and its gloo path is CI's (tests/test_sglang_cells.py)."""
    if plan.engine != "sglang":
        return {"skipped": "the embedded engine has no /update_weights_from_distributed (engine.weight_sync=disk)"}
    return {"skipped": "NCCL refuses a group with the trainer and the engine on one GPU ('Duplicate GPU detected'); "
            "the same-GPU path is weight_sync's tensor_s (docs/gpu.md)"}  # fmt: skip


HICACHE_PROMPT_TOKENS = 2048  # the prefix one server computes and the other loads from the store
HICACHE_MEM_FRACTION = 0.3  # of the GPU, per server: two servers side by side


def hicache_config(plan: Plan, master: str) -> Any:
    """A server of the pair: HiCache writing every computed page through to a Mooncake store (tcp on loopback),
    prefetch waiting for the whole prefix (docs/gpu.md, KV kept on reroute)."""
    from gyre.config.schema import EngineConfig

    extra = {"master_server_address": master, "protocol": "tcp", "device_name": "", "local_hostname": "127.0.0.1",
             "metadata_server": "P2PHANDSHAKE", "global_segment_size": "2gb"}  # fmt: skip
    cfg = EngineConfig(backend="sglang", mem_fraction_static=HICACHE_MEM_FRACTION, dtype=plan.engine_dtype,
                       python=sys.executable, startup_timeout_s=600, enable_memory_saver=False,
                       enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                       hicache_write_policy="write_through", hicache_storage_prefetch_policy="wait_complete",
                       hicache_storage_extra_config=json.dumps(extra))  # fmt: skip
    return cfg


def hicache_servers(plan: Plan, model_dir: Path, workdir: Path, master: str) -> list[Any]:
    """Two SGLang servers of hicache_config on the one GPU, sharing the store."""
    from gyre.engine.sglang_backend import start_sglang_server

    cfg = hicache_config(plan, master)
    servers: list[Any] = []
    try:
        for name in ("a", "b"):
            servers.append(start_sglang_server(model_dir, cfg, log_path=workdir / f"hicache_{name}.log"))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def prefill_request(tokens: list[int]) -> dict[str, Any]:
    return {"input_ids": tokens, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}


def prefill(url: str, tokens: list[int]) -> tuple[dict[str, Any], float]:
    """One token generated after `tokens`; SGLang's meta_info (cached_tokens: the prefix it did not compute)."""
    from gyre.engine.client import SyncEngineClient

    t = time.perf_counter()
    body = SyncEngineClient(url, timeout_s=600).post("/generate", prefill_request(tokens))
    return body["meta_info"], time.perf_counter() - t


def hicache(plan: Plan, model_dir: Path, workdir: Path) -> dict[str, Any]:
    """A prefix computed on one SGLang server, written through HiCache to a Mooncake store, loaded by another
    server instead of prefilled: the prompt tokens each computed (prompt - cached_tokens) and the times."""
    if plan.engine != "sglang":
        return {"skipped": "the embedded engine has no hierarchical cache (engine.backend=sglang only)"}
    free, total = gpu_free_gib(), _gpu_total_gib()
    if free is None or free < 2.2 * HICACHE_MEM_FRACTION * total:
        return {"skipped": f"{free} GiB free of {total}: two servers of {HICACHE_MEM_FRACTION} each do not fit"}
    from gyre.engine.hicache import start_master

    master = start_master("127.0.0.1", workdir / "mooncake_master.log")
    try:
        a, b = hicache_servers(plan, model_dir, workdir, master.address)
        try:
            prompt = [(7 * i) % 1000 + 10 for i in range(HICACHE_PROMPT_TOKENS)]
            control = [(11 * i) % 1000 + 10 for i in range(HICACHE_PROMPT_TOKENS)]
            first, first_s = prefill(a.url, prompt)
            time.sleep(5.0)  # write-through to host, then the store's backup thread
            second, second_s = prefill(b.url, prompt)
            cold, cold_s = prefill(b.url, control)
        finally:
            a.stop()
            b.stop()
    finally:
        master.stop()
    computed = {k: HICACHE_PROMPT_TOKENS - m["cached_tokens"] for k, m in (("a", first), ("b", second), ("cold", cold))}
    return {"prompt_tokens": HICACHE_PROMPT_TOKENS, "prefill_tokens": computed, "a_s": round(first_s, 3),
            "b_from_store_s": round(second_s, 3), "b_cold_s": round(cold_s, 3),
            "b_cached_tokens_details": second.get("cached_tokens_details")}  # fmt: skip


def _gpu_total_gib() -> float:
    import torch

    return round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2) if torch.cuda.is_available() else 0.0


def cell_cycle(plan: Plan, workdir: Path) -> dict[str, Any]:
    """One cell's rollout -> train -> rollout through launch.run (scheduler=colocate_cells: the cell job's
    runtime with one cell of one rank), one step: the step's rows say what it took."""
    out = workdir / "cell_cycle"
    cmd = [sys.executable, "-m", "launch.run", "scheduler=colocate_cells", "cluster.satellites=[]", "steps=1",
           f"engine={plan.engine}", "rl.groups_per_step=1", "rl.group_size=2", "harness.max_turns=2",
           "warm_start.steps=2", "warm_start.demos=8", "warm_start.batch_size=4", "tokenizer.corpus_tasks=40",
           "tokenizer.vocab_size=512", f"output_dir={out}", f"hydra.run.dir={out}/hydra"]  # fmt: skip
    if plan.engine == "sglang":
        # the engine shares the trainer's one GPU: new weights as CUDA IPC handles (distributed is refused there)
        cmd += ["engine.dtype=bfloat16", "engine.mem_fraction_static=0.4", "engine.weight_sync=tensor"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    if proc.returncode:
        raise RuntimeError(f"launch.run exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    from gyre.sched.controller.report import step_rows

    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    steps = step_rows(rows)
    if not steps:
        raise RuntimeError(f"launch.run wrote no step rows under {out}")
    keep = (
        "step",
        "version",
        "rollout_s",
        "reduce_s",
        "sync_s",
        "wall_s",
        "n_rollouts",
        "reward_mean",
        "train/trained",
    )
    switches = {r["direction"]: r["latency_s"] for r in rows if r.get("event") == "switch" and not r.get("initial")}
    return {"wall_s": round(time.perf_counter() - t0, 1), "steps": len(steps), "switch_latency_s": switches,
            "last_step": {k: v for k, v in steps[-1].items() if k in keep}}  # fmt: skip


def role_switch(plan: Plan, engine_url: str, checkpoint: Path) -> dict[str, Any]:
    """rollout -> train (pause retract + release all memory) and train -> rollout (resume weights, load the
    trainer's checkpoint, resume KV, continue), with requests in flight across the switch."""
    from gyre.engine.client import EngineClient, SamplingParams
    from gyre.engine.engine import EngineServers
    from gyre.engine.switch import join_rollout, leave_rollout

    servers = EngineServers([engine_url])

    async def scenario() -> dict[str, Any]:
        client = EngineClient(engine_url)
        down, up, free = [], [], {"before": [], "released": [], "resumed": []}
        try:
            for i in range(plan.switch_repeats):
                inflight = [asyncio.create_task(client.generate([5 + i, 6, 7, 8], SamplingParams(max_new_tokens=64)))
                            for _ in range(4)]  # fmt: skip
                await asyncio.sleep(0.2)
                free["before"].append(gpu_free_gib())
                d = await asyncio.to_thread(leave_rollout, servers, "retract")
                free["released"].append(gpu_free_gib())
                update = lambda v=f"switch{i}": servers.update_weights_from_disk(checkpoint, v)  # noqa: E731
                u = await asyncio.to_thread(join_rollout, servers, update)
                free["resumed"].append(gpu_free_gib())
                results = await asyncio.gather(*inflight)  # retracted requests finish after the switch
                if any(r.finish_reason == "abort" for r in results):
                    raise RuntimeError("a request in flight across the role switch was aborted")
                down.append(d)
                up.append(u)
        finally:
            await client.close()
        out: dict[str, Any] = {
            "rollout_to_train_s": round(median([d.total_s for d in down]), 4),
            "train_to_rollout_s": round(median([u.total_s for u in up]), 4),
            "pause_s": round(median([d.pause_s for d in down]), 4),
            "release_s": round(median([d.release_s for d in down]), 4),
            "resume_weights_s": round(median([u.resume_weights_s for u in up]), 4),
            "weight_load_s": round(median([u.sync_s for u in up]), 4),
            "resume_kv_s": round(median([u.resume_kv_s for u in up]), 4),
            "continue_s": round(median([u.continue_s for u in up]), 4),
        }
        if free["before"][0] is not None:
            out["gpu_free_gib"] = {k: median(v) for k, v in free.items()}
        return out

    return asyncio.run(scenario())


def _tree_bench() -> Any:
    try:
        import tools.bench_tree_training as bench
        from gyre.train.tree_pack import pack_trees, weighted_token_loss
    except ImportError as e:
        raise RuntimeError(
            f"tree packing is not available in this checkout ({e}); gyre/train/tree_pack.py, "
            "gyre/train/tree_attention.py and tools/bench_tree_training.py are needed for the tree sections"
        ) from e
    return bench, pack_trees, weighted_token_loss


def tree_vs_expanded(plan: Plan, trainer: Any) -> dict[str, Any]:
    """Forward-backward time of one tree-packed micro-batch set vs every root-to-leaf path packed alone."""
    bench, _, weighted_token_loss = _tree_bench()
    shape = bench.scaled_shape(plan.tree_scale, plan.tree_calls, 0.05, trainer.model_cfg.vocab_size)
    tree = bench.rollout_tree(shape, seed=0)
    out: dict[str, Any] = {"rollout_calls": plan.tree_calls, "tree_scale": plan.tree_scale}
    for label, k in (("k5", 5), ("unbounded", bench.UNBOUNDED)):
        sampled, variants, call_tokens = bench.variants(tree, k, plan.tree_budget)

        def fwd_bwd(batches: list) -> float:
            trainer.zero_grad()
            synchronize()
            t0 = time.perf_counter()
            trainer.forward_backward(batches, weighted_token_loss)
            synchronize()
            return time.perf_counter() - t0

        for v in variants:
            fwd_bwd(v.batches)  # warm-up
        times = {v.name: [] for v in variants}
        for _ in range(plan.fwd_bwd_repeats):
            for v in variants:
                times[v.name].append(fwd_bwd(v.batches))
        tree_s, paths_s = median(times["tree"]), median(times["paths"])
        out[label] = {
            "paths": int(sampled.n_paths),
            "tree_tokens": variants[0].tokens,
            "expanded_tokens": variants[1].tokens,
            "per_call_tokens": int(call_tokens),
            "tree_fwd_bwd_s": round(tree_s, 4),
            "expanded_fwd_bwd_s": round(paths_s, 4),
            "speedup": round(paths_s / tree_s, 3),
        }
    trainer.zero_grad()
    return out


def tree_path_agreement(plan: Plan, trainer: Any) -> dict[str, Any]:
    """Per-token logprobs of one tree-packed pass vs each root-to-leaf path run alone as a plain sequence."""
    import torch

    bench, pack_trees, _ = _tree_bench()
    from gyre.traj.expand import expand_paths

    # frequent retries: many branch points, so the paths share prefixes of every length
    shape = bench.scaled_shape(plan.tree_scale, plan.tree_calls, 0.3, trainer.model_cfg.vocab_size)
    tree = bench.rollout_tree(shape, seed=1)
    mb = pack_trees([tree], tree.n_tokens)[0]
    packed_at = {int(src): i for i, src in enumerate(mb.source_index.tolist())}
    leaves = tree.leaves()
    chosen = [int(x) for x in leaves[:: max(1, len(leaves) // plan.agreement_paths)][: plan.agreement_paths]]
    worst, compared = 0.0, 0
    with torch.no_grad():
        tree_lp = trainer.tree_token_logprobs(mb).float().cpu()
        for path in expand_paths(tree, chosen):
            tokens = torch.as_tensor(path.tokens, dtype=torch.long)[None]
            path_lp = trainer.token_logprobs(tokens)[0].float().cpu()  # [L-1]: token j from positions < j
            idx = torch.tensor([packed_at[int(n)] for n in path.nodes[1:]])
            worst = max(worst, float((tree_lp[idx] - path_lp).abs().max()))
            compared += len(idx)
    return {"tree_tokens": mb.n_tokens, "paths": len(chosen), "tokens_compared": compared,
            "max_abs_logprob_diff": worst, "trainer_dtype": "float32"}  # fmt: skip


# ----- main -----


def run(plan: Plan, out_path: Path, install: bool) -> Report:
    report = Report()
    t_start = time.perf_counter()
    if install:
        report.section("install", lambda: {"installed": ensure_installed(print)})
    import torch

    if plan.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device; use --tiny for the CPU exercise")
    report.section("environment", lambda: environment(plan))
    with tempfile.TemporaryDirectory(prefix="gyre-gpu-check-") as tmp:
        workdir = Path(tmp)
        model_dir, model_cfg = build_model(plan, workdir)
        engine = start_engine_process(plan, model_dir, workdir)
        trainer = None
        try:
            report.section("generation", lambda: generation_throughput(plan, model_dir, engine.url))
            made: dict[str, Any] = {}

            def trainer_section() -> dict[str, Any]:
                made["trainer"], info = make_trainer(plan, model_cfg, model_dir)
                return info

            report.section("trainer", trainer_section)
            trainer = made.get("trainer")
            if trainer is not None:
                report.section("weight_sync", lambda: weight_sync(plan, trainer, model_cfg, engine.url, workdir))
                report.section("distributed_sync", lambda: distributed_sync(plan))
                checkpoint = workdir / "sync" if (workdir / "sync").exists() else model_dir
                report.section("role_switch", lambda: role_switch(plan, engine.url, checkpoint))
                report.section("tree_vs_expanded", lambda: tree_vs_expanded(plan, trainer))
                report.section("tree_path_agreement", lambda: tree_path_agreement(plan, trainer))
        finally:
            engine.stop()
            report.figures["engine_log_tail"] = engine.log_tail(20) if report.errors else ""
        trainer = None  # the cell's own trainer and engine take the device next
        made.clear()
        if torch.cuda.is_available():
            import gc

            gc.collect()
            torch.cuda.empty_cache()
        report.section("hicache", lambda: hicache(plan, model_dir, workdir))
        report.section("cell_cycle", lambda: cell_cycle(plan, workdir))
    report.figures["total_s"] = round(time.perf_counter() - t_start, 1)
    out_path.write_text(json.dumps({**asdict(report), "ok": not report.errors}, indent=2))
    print(f"gpu_check: wrote {out_path} ({'ok' if not report.errors else 'errors: ' + ', '.join(report.errors)})")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny Qwen3: exercises every section in about a minute")
    p.add_argument("--no-install", action="store_true", help="skip pip (everything is installed already)")
    p.add_argument("--prepare-wheels", action="store_true", help="download ./wheels for the offline GPU machine")
    args = p.parse_args(argv)
    if args.prepare_wheels:
        prepare_wheels()
        return 0
    plan = Plan.for_run(args.tiny, args.engine)
    if args.tiny and args.engine == "sglang":
        plan = replace(plan, device="cuda")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    report = run(plan, Path(args.out), install=not args.no_install and not args.tiny)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
