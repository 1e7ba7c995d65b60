"""What every rank of a cell job checks with the others before anything starts (no engine, no warm start):
the address it advertises, resolved once on its own node and reachable from the other ranks' hosts
(gyre.comm.address), and the output directory, which every node must see (shards, checkpoints,
policy.json and the warm start pass through it). Every rank gets the same findings (allgather) and
raises the same error, naming the key or the setup to change."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from gyre.comm.address import AddressError, advertise_address, check_reachable, this_rank
from gyre.config.schema import RunConfig
from gyre.errors import UserError

SHARED_FS_WAIT_S = 10.0  # NFS may show another node's new file only after its attribute cache expires


GLOO_UNSUPPORTED = (
    "comm.transfer_backend=gloo: the cell job cannot run on it, on one host or several: gloo needs one "
    "torch.distributed world over every rank, where each cell's Megatron replica then builds its parallel groups "
    "(collectives the controller never joins) and the cells hang; use comm.transfer_backend=mooncake (TCP on CPU, "
    "RDMA on clusters)"
)


class PreflightError(UserError, RuntimeError):
    """The job cannot work as configured on these nodes; the message says what to change."""


def describe_rank(rank: int, env: dict[str, str] | None = None, place: tuple[int, int] | None = None) -> str:
    """`place`: (cell, rank in the cell), -1 the controller; default: one rank per cell after the controller."""
    env = os.environ if env is None else env
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    cell, index = place if place is not None else (rank - 1, 0)
    who = "the controller" if cell < 0 else f"cell {cell}" if index == 0 else f"cell {cell}'s rank {index}"
    return f"{who} on {node}"


def _markers_seen(folder: Path, size: int, deadline: float) -> list[int]:
    """Ranks whose marker file this rank cannot see (after waiting up to the deadline)."""
    while True:
        missing = [r for r in range(size) if not (folder / f"rank{r}").exists()]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)
        os.listdir(folder)  # revalidates the directory's cached listing on NFS


def run_preflight(world: Any, cfg: RunConfig, out: Path, start_id: str, place: tuple[int, int] | None = None) -> str:
    """This rank's advertised address, once every rank has checked the addresses and the output directory.
    `place`: this rank's (cell, rank in the cell), for the messages."""
    rank, size = world.Get_rank(), world.Get_size()
    where = describe_rank(rank, place=place)
    try:
        me: Any = this_rank(rank, where, advertise_address(cfg.comm.hostname, cfg.comm.interface))
    except AddressError as e:
        me = f"{where} (rank {rank}): {e}"
    folder = out / ".preflight" / start_id
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}").write_text(where)
        write_error = ""
    except OSError as e:
        write_error = f"{where} cannot write {folder} ({e})"
    world.Barrier()
    missing = [] if write_error else _markers_seen(folder, size, time.monotonic() + SHARED_FS_WAIT_S)
    found = world.allgather((me, write_error, missing))
    problems = [m for m, _, _ in found if isinstance(m, str)]
    if cfg.comm.transfer_backend == "gloo":
        problems.append(GLOO_UNSUPPORTED)
    try:
        check_reachable([m for m, _, _ in found if not isinstance(m, str)], cfg.comm.hostname, cfg.engine.host)
    except AddressError as e:
        problems.append(str(e))
    problems += [err for _, err, _ in found if err]
    names = [m.where if not isinstance(m, str) else f"rank {r}" for r, (m, _, _) in enumerate(found)]
    for r, (_, _, miss) in enumerate(found):
        if miss:
            problems.append(
                f"output_dir {out} is not shared: {names[r]} does not see the files of {[names[m] for m in miss]}; "
                "put output_dir on a filesystem every node mounts at the same path (docs/slurm.md: What the nodes share)"
            )
    world.Barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    if problems:
        raise PreflightError("the cell job cannot start:\n" + "\n".join(problems))
    return me.address
