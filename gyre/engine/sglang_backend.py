"""SGLang rollout engines: the servers of a cell (one per tensor-parallel group, over several nodes when
engine.tp_size exceeds a node), their command lines, the check that SGLang's runtime is there, and the
SGLang side of weight updates. `SGLangEngine` is the RolloutEngine (gyre/engine/engine.py) for
engine.backend=sglang; role switches go through gyre.engine.switch like every engine's.

    plan = plan_servers(model_dir, cfg.engine, cfg.model, nodes=["n1", "n2"], gpus_per_node=8)
    engine = SGLangEngine(cfg.engine, setup); engine.start(model_dir)   # waits for /health_generate

Flag names follow sglang/srt/arg_groups/fields/*.py (tests parse our argv with SGLang's own parser).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gyre.config.schema import EngineConfig, ModelConfig, resolved_weight_sync
from gyre.engine.admin_key import sglang_key_config
from gyre.engine.client import SyncEngineClient
from gyre.engine.engine import EngineServers, EngineSetup, EngineUnsupported, stop_processes
from gyre.engine.launcher import EngineProcess, EngineStartError, _tail
from gyre.errors import UserError
from gyre.lifetime import spawn_tied

if TYPE_CHECKING:
    import torch

MEMORY_TAGS = ("weights", "kv_cache")
# Set truthy, SGLang 0.5.23 returns log_softmax of the logits before temperature (layers/sampler.py), not the
# tempered distribution the trainer scores the tokens under (gyre/train/sampling_logprobs.py).
ORIGINAL_LOGPROB_ENV = "SGLANG_RETURN_ORIGINAL_LOGPROB"


def sglang_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment; refuses the setting that would make its logprobs untempered."""
    out = {**os.environ, **(env or {})}
    if out.get(ORIGINAL_LOGPROB_ENV, "false").lower() in ("true", "1"):
        raise ValueError(
            f"{ORIGINAL_LOGPROB_ENV}={out[ORIGINAL_LOGPROB_ENV]} makes SGLang return logprobs before temperature, "
            "which the trainer does not score; unset it (gyre trains the tempered distribution, see docs/architecture.md, GSPO)"
        )
    return out


DIST_INIT_PORT_OFFSET = 50  # a multi-node server's torch.distributed rendezvous: its HTTP port + this
# The SGLang release whose parser and request dataclasses the tests check gyre against; gyre[gpu] pins it and
# tools/setup_env.sh installs its source.
SGLANG_VERSION = "0.5.23"
# what SGLang needs at run time beyond its source (its CUDA kernels, a CUDA build of torch), and then the
# versions the trainer must agree with (one JSON line)
RUNTIME_PROBE = """
import importlib.util, json, sys
missing = [m for m in ("sglang", "sgl_kernel", "torch") if importlib.util.find_spec(m) is None]
if missing:
    print("missing " + " ".join(missing)); sys.exit(3)
import importlib.metadata, torch
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA device"); sys.exit(4)
nccl = ".".join(map(str, torch.cuda.nccl.version()))
print(json.dumps({"sglang": importlib.metadata.version("sglang"), "torch": torch.__version__, "nccl": nccl}))
"""


def trainer_runtime() -> dict[str, str]:
    """This process's torch and NCCL versions, in the probe's terms (nccl "" without CUDA)."""
    import torch

    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else ""
    return {"torch": torch.__version__, "nccl": nccl}


def _release(version: str) -> str:
    return version.split("+")[0]


def runtime_skew(engine: dict[str, str], trainer: dict[str, str], weight_sync: str) -> list[str]:
    """What cannot work between the engine's interpreter (engine.python, RUNTIME_PROBE) and the trainer's:
    SGLang other than the release gyre's requests are checked against; for weight_sync=distributed two NCCL
    releases in one broadcast group (NCCL needs one version on every rank); for tensor two torch releases
    unpickling each other's CUDA IPC handles. Disk updates cross any skew."""
    problems = []
    if engine.get("sglang") != SGLANG_VERSION:
        problems.append(f"SGLang {engine.get('sglang')} where gyre speaks {SGLANG_VERSION}'s requests "
                        f'(pip install "gyre[gpu]" or sglang=={SGLANG_VERSION})')  # fmt: skip
    if weight_sync == "distributed" and trainer.get("nccl") and engine.get("nccl") != trainer["nccl"]:
        problems.append(f"NCCL {engine.get('nccl')} in the engine, {trainer['nccl']} in the trainer: one broadcast "
                        "group needs one NCCL (one environment, gyre[gpu], or engine.weight_sync=disk)")  # fmt: skip
    if weight_sync == "tensor" and _release(engine.get("torch", "")) != _release(trainer.get("torch", "")):
        problems.append(f"torch {engine.get('torch')} in the engine, {trainer.get('torch')} in the trainer: CUDA IPC "
                        "handles are pickled by one torch and read by the other (one environment, or weight_sync=disk)")  # fmt: skip
    return problems


class SGLangUnavailable(UserError, EngineStartError):
    """engine.backend=sglang on a node whose engine.python cannot run SGLang's server."""


def free_port(host: str = "127.0.0.1") -> int:
    """SGLang needs a concrete port (it binds several: HTTP, NCCL, ZMQ); 0 in config means pick one here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sglang_server_args(
    model_path: str | Path,
    cfg: EngineConfig,
    port: int,
    model: ModelConfig | None = None,
    weight_version: str = "default",
    served_model_name: str | None = None,
    base_gpu_id: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    dist_init_addr: str = "",
    key_dir: str | Path | None = None,
    routed_experts: bool = False,
    key_file: str | None = None,
) -> list[str]:
    """The `python -m sglang.launch_server` arguments for one server of a cell (on one of its nodes when
    the server spans `nnodes`; every node of it gets the same arguments but --node-rank). The admin key's
    file goes to `key_dir` (a directory every node of the server reads; default: a private temporary one);
    `key_file` names one instead and writes nothing (the command lines a generated script shows)."""
    if cfg.backend != "sglang":
        raise ValueError(f"engine.backend={cfg.backend!r}: SGLang command lines are for engine.backend=sglang")
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port; pick one with free_port()")
    argv = [
        "--model-path", str(model_path),
        "--host", cfg.host,
        "--port", str(port),
        "--tp-size", str(cfg.tp_size),
        "--mem-fraction-static", str(cfg.mem_fraction_static),
        "--max-running-requests", str(cfg.max_running_requests),
        "--context-length", str(cfg.max_context_tokens),
        "--dtype", cfg.dtype,
        "--load-format", cfg.load_format,
        "--weight-version", weight_version,
        "--random-seed", str(cfg.random_seed),
        "--base-gpu-id", str(cfg.base_gpu_id if base_gpu_id is None else base_gpu_id),
        "--log-level", cfg.log_level,
    ]  # fmt: skip
    # The run's key for every route but /health*: admin routes for the controller and cells only, and
    # /server_info, which lists the server args (the admin key among them), closed as well. From a file of
    # SGLang's --config, mode 0600: never on a command line, which /proc/<pid>/cmdline shows to anyone.
    argv += ["--config", key_file if key_file is not None else str(sglang_key_config(key_dir))]
    argv += _feature_args(cfg, routed_experts)
    if cfg.pp_size > 1:
        argv += ["--pp-size", str(cfg.pp_size)]
    if nnodes > 1:
        if not dist_init_addr:
            raise ValueError("a server over several nodes needs dist_init_addr (its first node's host:port)")
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    return argv + list(cfg.extra_args)


def _feature_args(cfg: EngineConfig, routed_experts: bool) -> list[str]:
    """The flags and options of the features a config turns on (memory saver, caches, routed experts)."""
    flags = {
        "--enable-memory-saver": cfg.enable_memory_saver,
        "--enable-weights-cpu-backup": cfg.enable_weights_cpu_backup,
        "--disable-radix-cache": cfg.disable_radix_cache,
        "--enable-hierarchical-cache": cfg.enable_hierarchical_cache,
        # rl.routing_replay: a request's return_routed_experts is honoured only with it (enable_return_routed_experts)
        "--enable-return-routed-experts": routed_experts,
    }
    argv = [flag for flag, on in flags.items() if on]
    if cfg.chunked_prefill_size:
        argv += ["--chunked-prefill-size", str(cfg.chunked_prefill_size)]
    if cfg.enable_hierarchical_cache:
        argv += ["--hicache-write-policy", cfg.hicache_write_policy]
    if cfg.hicache_storage_backend:
        argv += ["--hicache-storage-backend", cfg.hicache_storage_backend,
                 "--hicache-storage-prefetch-policy", cfg.hicache_storage_prefetch_policy]  # fmt: skip
        if cfg.hicache_storage_extra_config:
            argv += ["--hicache-storage-backend-extra-config", cfg.hicache_storage_extra_config]
    return argv


def sglang_launch_command(
    model_path: str | Path, cfg: EngineConfig, port: int, model: ModelConfig | None = None, **kwargs: Any
) -> list[str]:
    return [cfg.python, "-m", "sglang.launch_server", *sglang_server_args(model_path, cfg, port, model, **kwargs)]


def wait_until_serving(engine: EngineProcess, timeout_s: float, poll_s: float = 1.0) -> EngineProcess:
    """Block until the engine answers /health_generate (it generated a token), or raise with its log."""

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not engine.alive():
            code = engine.stop()
            raise EngineStartError(
                f"engine at {engine.url} exited with code {code} before serving; log {engine.log_path}:\n"
                f"{_tail(engine.log_path)}"
            )
        if SyncEngineClient(engine.url, timeout_s=30.0).health_generate():
            return engine
        time.sleep(poll_s)
    engine.stop()
    raise EngineStartError(
        f"engine at {engine.url} not serving after {timeout_s:.0f}s (raise engine.startup_timeout_s for big "
        f"checkpoints); log {engine.log_path}:\n{_tail(engine.log_path)}"
    )


def start_sglang_process(cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> EngineProcess:
    """Start one SGLang process in its own process group (not waiting for it), dying with this process
    (gyre.lifetime); output to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_file = open(log_path, "w")  # noqa: SIM115 - owned by the EngineProcess
    try:
        proc = spawn_tied(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          env=sglang_env(env), start_new_session=True)  # fmt: skip
    except OSError as e:
        log_file.close()
        raise EngineStartError(f"cannot run {cmd[0]!r} ({e}); set engine.python to an interpreter with sglang") from e
    return EngineProcess(proc, "", log_path, "", log_file)


def start_sglang_server(
    model_path: str | Path,
    cfg: EngineConfig,
    model: ModelConfig | None = None,
    port: int | None = None,
    log_path: str | Path | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> EngineProcess:
    """Launch one SGLang server here and wait until it serves (tools/gpu_check.py; cells use SGLangEngine)."""
    port = port or cfg.port or free_port(cfg.host)
    cmd = sglang_launch_command(model_path, cfg, port, model, **kwargs)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="gyre-sglang-", suffix=".log")
        os.close(fd)
        log_path = name
    engine = start_sglang_process(cmd, Path(log_path), env)
    engine.url, engine.model_path = f"http://{cfg.host}:{port}", str(model_path)
    return wait_until_serving(engine, cfg.startup_timeout_s)


@dataclass(frozen=True)
class ServerLaunch:
    """One `sglang.launch_server` process: on which node, as which node rank of its server."""

    server: int  # index of the server (tensor-parallel group) in the cell
    node: str  # "" = this host
    node_rank: int
    port: int  # the server's HTTP port (served by node rank 0)
    argv: list[str]

    @property
    def serves_http(self) -> bool:
        return self.node_rank == 0


def plan_servers(
    model_path: str | Path,
    cfg: EngineConfig,
    model: ModelConfig | None = None,
    nodes: list[str] | None = None,
    gpus_per_node: int = 0,
    weight_version: str = "default",
    port: int | None = None,
    key_dir: str | Path | None = None,
    routed_experts: bool = False,
    key_file: str | None = None,
) -> list[ServerLaunch]:
    """Every SGLang process of a cell: one server per group of engine.tp_size x pp_size GPUs.

    nodes: the cell's hosts, this one first ("" or one entry: this host only). gpus_per_node=0: unknown,
    one server over tp_size x pp_size GPUs from engine.base_gpu_id. When a server's GPUs exceed a node, it spans
    (tp_size x pp_size) / gpus_per_node nodes (--nnodes, --node-rank, --dist-init-addr on its first node).
    """
    nodes = list(nodes or [""])
    span = cfg.tp_size * cfg.pp_size
    what = f"engine.tp_size={cfg.tp_size}" + (f" x pp_size={cfg.pp_size} ({span} GPUs)" if cfg.pp_size > 1 else "")
    base = port or cfg.port
    if len(nodes) > 1 and not cfg.port:
        raise ValueError("engine.port=0 cannot pick free ports on other nodes; set engine.port (e.g. 30000)")
    base = base or free_port(cfg.host)
    if gpus_per_node <= 0 or span <= gpus_per_node:
        if gpus_per_node > 0 and gpus_per_node % span:
            raise ValueError(f"{what} does not divide the cell's {gpus_per_node} GPUs per node")
        per_node = gpus_per_node // span if gpus_per_node > 0 else 1
        launches = []
        for n, node in enumerate(nodes):
            for k in range(per_node):
                server, server_port = n * per_node + k, base + k
                gpu = cfg.base_gpu_id + k * span
                argv = sglang_server_args(model_path, cfg, server_port, model, weight_version, base_gpu_id=gpu,
                                          key_dir=key_dir, routed_experts=routed_experts, key_file=key_file)  # fmt: skip
                launches.append(ServerLaunch(server, node, 0, server_port, argv))
        return launches
    if span % gpus_per_node or len(nodes) % (span // gpus_per_node):
        raise ValueError(
            f"{what} over nodes of {gpus_per_node} GPUs needs whole nodes: a multiple of "
            f"{gpus_per_node} whose node count divides the cell's {len(nodes)} nodes"
        )
    nnodes = span // gpus_per_node
    if any(not n for n in nodes):
        raise ValueError(f"a server over {nnodes} nodes needs the cell's host names; got {nodes}")
    launches = []
    for server in range(len(nodes) // nnodes):
        group = nodes[server * nnodes : (server + 1) * nnodes]
        addr = f"{group[0]}:{base + DIST_INIT_PORT_OFFSET}"
        for rank, node in enumerate(group):
            argv = sglang_server_args(model_path, cfg, base, model, weight_version, nnodes=nnodes, node_rank=rank,
                                      dist_init_addr=addr, key_dir=key_dir, routed_experts=routed_experts,
                                      key_file=key_file)  # fmt: skip
            launches.append(ServerLaunch(server, node, rank, base, argv))
    return launches


def launch_command(cfg: EngineConfig, launch: ServerLaunch, local_node: str = "") -> list[str]:
    """The process to start for `launch`: here, or on another node of the allocation through srun."""
    cmd = [cfg.python, "-m", "sglang.launch_server", *launch.argv]
    if launch.node in ("", local_node):
        return cmd
    return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={launch.node}", "--kill-on-bad-exit=1", *cmd]


def check_sglang_runtime(python: str, env: dict[str, str] | None = None, weight_sync: str = "disk") -> dict[str, str]:
    """Raise SGLangUnavailable, saying what to install, unless `python` can run SGLang's server here with
    weights from this trainer by `weight_sync` (runtime_skew); its versions otherwise."""
    try:
        probe = subprocess.run([python, "-c", RUNTIME_PROBE], capture_output=True, text=True, timeout=300,
                               env={**os.environ, **(env or {})})  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SGLangUnavailable(f"engine.python={python!r} cannot run ({e}); set engine.python to an "
                                "interpreter with SGLang installed") from e  # fmt: skip
    if probe.returncode == 0:
        versions = json.loads(probe.stdout.strip().splitlines()[-1])
        if problems := runtime_skew(versions, trainer_runtime(), weight_sync):
            raise SGLangUnavailable(f"engine.python={python}: " + "; ".join(problems))
        return versions
    why = (probe.stdout.strip() or probe.stderr.strip()[-500:]) or f"exit code {probe.returncode}"
    raise SGLangUnavailable(
        f"engine.backend=sglang: {python} cannot serve SGLang on this node ({why}). Install SGLang's runtime on "
        f'the GPU nodes (`pip install "gyre[gpu]"`, or `pip install "sglang[all]"` at {SGLANG_VERSION} with a CUDA '
        "build of torch, which brings sgl_kernel) or point engine.python at an interpreter that has it; "
        "`pip install --no-deps sglang` (tools/setup_env.sh) holds only its source, for the payload tests; on a "
        "CPU machine use engine.backend=embedded"
    )


# ----- the engine side of weight updates (any server speaking SGLang's protocol) -----


@contextmanager
def weight_update_session(clients: list[SyncEngineClient]) -> Iterator[None]:
    """SGLang 0.5.23 loads weights from tensors or a broadcast only inside a session it opens at
    /begin_weight_update and closes at /end_weight_update (scheduler_components/weight_updater.py); the
    session is closed again when the loads fail, so that the next update can open one."""
    opened = []
    try:
        for c in clients:
            c.begin_weight_update()
            opened.append(c)
        yield
    finally:
        for c in opened:
            c.end_weight_update()


def update_from_tensor(servers: EngineServers, state: dict[str, torch.Tensor], version: str, tp_size: int) -> None:
    """Same-node update; `state` holds HF-named tensors (CUDA tensors go as IPC handles)."""
    from gyre.engine.sglang_weights import serialize_named_tensors

    with weight_update_session(servers.clients):
        for c in servers.clients:
            c.update_weights_from_tensor(serialize_named_tensors(state.items(), tp_size), version)
    servers.check_version(version)


def update_from_distributed(client: SyncEngineClient, state: dict[str, torch.Tensor], version: str, group: Any,
                            group_name: str = "weight_update_group", bucket_bytes: int | None = None,
                            session: bool = True) -> None:  # fmt: skip
    """Broadcast `state` from trainer rank 0 of `group` (sglang_weights.open_weight_update_group) while the
    engine receives it, one flattened bucket per request (sglang_weights.weight_buckets), in a weight-update
    session of its own (session=False: in one the caller holds open, as a cell's leader does for its ranks)."""
    from gyre.engine.sglang_weights import BUCKET_BYTES, weight_buckets

    with weight_update_session([client] if session else []):
        for bucket in weight_buckets(state, bucket_bytes or BUCKET_BYTES):
            send_bucket(client, bucket, version, group, group_name)
    EngineServers([client.base_url]).check_version(version)


def send_bucket(client: SyncEngineClient, bucket: dict[str, torch.Tensor], version: str, group: Any,
                group_name: str) -> None:  # fmt: skip
    """One `/update_weights_from_distributed` request (load_format flattened_bucket) and, while the engine
    waits in it, the bucket's bytes broadcast from rank 0 of `group`."""
    import torch.distributed as dist

    from gyre.engine.sglang_weights import FLATTENED_BUCKET, distributed_metadata, flatten_bucket

    names, dtypes, shapes = distributed_metadata(bucket)
    failed: list[BaseException] = []

    def request() -> None:
        try:
            client.update_weights_from_distributed(names, dtypes, shapes, version, group_name=group_name,
                                                   load_format=FLATTENED_BUCKET)  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            failed.append(e)

    thread = threading.Thread(target=request, name="gyre-weights-request", daemon=True)
    thread.start()
    dist.broadcast(flatten_bucket(bucket), src=0, group=group)
    thread.join()
    if failed:
        raise failed[0]


def open_distributed_group(client: SyncEngineClient, trainer_address: str, tp_size: int, group_name: str,
                           backend: str) -> Any:  # fmt: skip
    """The trainer (rank 0) and the server's tp_size ranks (from rank 1) in one broadcast group, on `backend`
    (the trainer's: gyre.train.backend.trainer_backend, gyre.sched.cell.world.weight_group_backend)."""
    from gyre.engine.sglang_weights import bind_weight_update_store, open_weight_update_group

    world = 1 + tp_size
    store = bind_weight_update_store(trainer_address, world)
    failed: list[BaseException] = []

    def request() -> None:
        try:
            client.init_weights_update_group(trainer_address, store.port, 1, world, group_name, backend)
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            failed.append(e)

    thread = threading.Thread(target=request, name="gyre-weights-group", daemon=True)
    thread.start()
    group = open_weight_update_group(trainer_address, store.port, world, group_name, backend, store=store)
    thread.join()
    if failed:
        raise failed[0]
    return group


def send_stage(model: torch.nn.Module, cfg: ModelConfig, clients: list[SyncEngineClient], version: str,
               trainer_address: str, engine_tp: int, groups: dict[str, Any], backend: str,
               bucket_bytes: int | None = None) -> int:  # fmt: skip
    """This trainer rank's part of a shard-to-shard update of a cell's SGLang servers (`clients`, each in a
    weight-update session the caller holds open): every rank of the cell calls it (the all-gathers of its
    stage's tensor- and expert-parallel shards); the first tensor-parallel rank of the first data-parallel
    replica names its stage's tensors as HF does and broadcasts them in buckets to each server over a group of
    its own (opened on first use at `trainer_address`, this rank's, and kept in `groups`). Returns the
    tensors this rank sent to each server (0 on the other ranks)."""
    from gyre.engine.sglang_weights import sends_weights, stage_hf_state, tp_merged_stage, weight_group_name
    from gyre.train.megatron_gpt import parallel_state

    stage = tp_merged_stage(model, cfg)
    ranks = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_data_parallel_rank()
    if not sends_weights(*ranks):
        return 0
    state = stage_hf_state(stage, cfg)
    for server, client in enumerate(clients):
        name = weight_group_name(server, parallel_state.get_pipeline_model_parallel_rank())
        if name not in groups:
            groups[name] = open_distributed_group(client, trainer_address, engine_tp, name, backend)
        update_from_distributed(client, state, version, groups[name], group_name=name, bucket_bytes=bucket_bytes,
                                session=False)  # fmt: skip
    return len(state)


class SGLangEngine:
    """The cell's SGLang servers as one RolloutEngine; new weights by engine.weight_sync (distributed:
    the trainer broadcasts to every server's TP ranks, one group per server, opened at the first update)."""

    backend = "sglang"

    def __init__(self, cfg: EngineConfig, setup: EngineSetup) -> None:
        self.cfg, self.setup = cfg, setup
        self.version = "0"
        self.weight_sync = resolved_weight_sync(cfg)
        from gyre.train.backend import trainer_backend  # torch only: no megatron import beside the replica's

        if self.weight_sync == "distributed" and trainer_backend() == "nccl":
            raise EngineUnsupported(
                "engine.weight_sync=distributed (what auto resolves to for SGLang): the server runs on the GPUs the "
                "trainer uses, and NCCL refuses a group with two ranks on one GPU ('Duplicate GPU detected'); set "
                "engine.weight_sync=tensor (a server within one node) or disk (docs/gpu.md)"
            )
        self.processes: list[EngineProcess] = []
        self.servers = EngineServers([])
        self.groups: dict[int, Any] = {}

    @property
    def urls(self) -> list[str]:
        return self.servers.urls

    @property
    def pid(self) -> int:
        return self.processes[0].pid if self.processes else -1

    def start(self, weights: Path) -> None:
        check_sglang_runtime(self.cfg.python, self.setup.env, self.weight_sync)
        plan = plan_servers(weights, self.cfg, self.setup.model_cfg, self.setup.nodes, self.setup.gpus_per_node,
                            weight_version=self.version, key_dir=self.setup.log_dir,
                            routed_experts=self.setup.routed_experts)  # fmt: skip
        local = self.setup.nodes[0] if self.setup.nodes else ""
        self.processes, heads = [], []
        try:
            for launch in plan:
                log = self.setup.log_dir / f"sglang{launch.server}-node{launch.node_rank}.log"
                proc = start_sglang_process(launch_command(self.cfg, launch, local), log, self.setup.env)
                host = self.cfg.host if launch.node in ("", local) else launch.node
                proc.url = f"http://{host}:{launch.port}"
                self.processes.append(proc)
                if launch.serves_http:
                    heads.append(proc)
            for proc in heads:
                wait_until_serving(proc, self.cfg.startup_timeout_s)
        except BaseException:
            stop_processes(self.processes)
            raise
        finally:  # every process of the servers has read its arguments (or is gone): the key's file goes
            for launch in plan:
                Path(launch.argv[launch.argv.index("--config") + 1]).unlink(missing_ok=True)
        self.servers = EngineServers([p.url for p in heads])
        self.groups = {}

    def alive(self) -> bool:
        return bool(self.processes) and all(p.alive() for p in self.processes) and self.servers.healthy()

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(f"== {p.log_path}\n{p.log_tail(lines)}" for p in self.processes) or "(not started)"

    def pause(self, mode: str) -> None:
        self.servers.pause(mode)

    def continue_generation(self) -> None:
        self.servers.continue_generation()

    def release_memory(self, tags: list[str] | None = None) -> None:
        self.servers.release_memory(tags)

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.servers.resume_memory(tags)

    def flush_cache(self) -> None:
        self.servers.flush_cache()

    def update_weights(self, state: dict[str, torch.Tensor], version: str) -> None:
        if self.weight_sync == "distributed":
            self.update_weights_from_distributed(state, version)
        elif self.weight_sync == "tensor":
            self.update_weights_from_tensor(state, version)
        else:
            from gyre.model.hf_io import save_hf_checkpoint

            cfg, tok = self.setup.model_cfg, self.setup.tokenizer_dir
            self.update_weights_from_disk(save_hf_checkpoint(self.setup.scratch / "current", state, cfg, tok), version)

    def update_weights_from_disk(self, path: Path, version: str) -> None:
        self.servers.update_weights_from_disk(path, version)
        self.version = version

    def update_weights_from_tensor(self, state: dict[str, torch.Tensor], version: str) -> None:
        update_from_tensor(self.servers, state, version, self.cfg.tp_size)
        self.version = version

    def update_weights_from_distributed(self, state: dict[str, torch.Tensor], version: str) -> None:
        """From this process's trainer (a cell of one rank), over a group on its trainer's backend."""
        from gyre.train.backend import trainer_backend

        for i, client in enumerate(self.servers.clients):
            name = f"gyre_weights_{i}"
            if i not in self.groups:
                address, tp = self.setup.trainer_address, self.cfg.tp_size
                self.groups[i] = open_distributed_group(client, address, tp, name, trainer_backend())
            update_from_distributed(client, state, version, self.groups[i], group_name=name)
        self.version = version

    def export_kv(self, prefixes: list[dict[str, Any]]) -> dict[str, Any]:
        raise EngineUnsupported("SGLang has no per-request KV export; set sched.kv_migration=false")

    def import_kv(self, sessions: list[dict[str, Any]]) -> dict[str, Any]:
        raise EngineUnsupported("SGLang has no per-request KV import; set sched.kv_migration=false")

    def stop(self) -> None:
        stop_processes(self.processes)
