"""Checks before submitting: Slurm on the PATH, partitions that exist, resources the cluster has.

A request Slurm cannot satisfy is often accepted and then pends forever (a heterogeneous job on a
single node does exactly that), so the cluster is read with `scontrol` and the request checked
first. Parsing and checking are pure functions; only `read_inventory` runs Slurm commands.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from gyre.comm.address import is_loopback
from gyre.config.schema import CellResources
from gyre.errors import UserError
from launch.slurm.plan import cell_key

UNUSABLE_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "FUTURE", "INVAL", "MAINT")
_FIELD = re.compile(r"([A-Za-z][\w:/]*)=(.*?)(?=\s+[A-Za-z][\w:/]*=|\s*$)")


class SlurmPreflightError(UserError, RuntimeError):
    """The request cannot run on this cluster; the message says what to change."""


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int
    partitions: tuple[str, ...]
    state: str
    address: str = ""  # NodeAddr: where the other nodes reach it

    @property
    def usable(self) -> bool:
        return not any(bad in self.state for bad in UNUSABLE_STATES)


@dataclass(frozen=True)
class Partition:
    name: str
    state: str
    max_time_s: int | None  # None: unlimited
    max_nodes: int | None


@dataclass(frozen=True)
class Inventory:
    partitions: dict[str, Partition]
    nodes: tuple[Node, ...]

    def nodes_of(self, partition: str) -> list[Node]:
        return [n for n in self.nodes if partition in n.partitions and n.usable]


def parse_records(text: str) -> list[dict[str, str]]:
    """`scontrol show ... -o` output: one record a line, `Key=value` fields (values may hold spaces)."""
    return [dict(_FIELD.findall(line)) for line in text.splitlines() if line.strip()]


def parse_time_s(text: str) -> int | None:
    """Slurm time syntax (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in seconds; None = unlimited."""
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        hours, minutes, seconds = parts
    else:
        hours, minutes, seconds = {1: [0, parts[0], 0], 2: [0, *parts], 3: parts}[len(parts)]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


def parse_mem_mb(text: str) -> int:
    """Slurm memory syntax ("4000", "16G", "512M", "1T") in MB; "0" means all of a node's memory."""
    match = re.fullmatch(r"(\d+)([KMGT]?)B?", text.strip().upper())
    if not match:
        raise SlurmPreflightError(f"memory {text!r} is not Slurm syntax; use e.g. 16G or 4000M")
    value, unit = int(match.group(1)), match.group(2) or "M"
    return {"K": value // 1024, "M": value, "G": value * 1024, "T": value * 1024 * 1024}[unit]


def _gpus(gres: str) -> int:
    total = 0
    for item in gres.split(","):
        fields = item.split("(")[0].split(":")
        if fields[0] == "gpu" and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def parse_inventory(partition_text: str, node_text: str) -> Inventory:
    partitions = {}
    for rec in parse_records(partition_text):
        max_nodes = rec.get("MaxNodes", "UNLIMITED")
        partitions[rec["PartitionName"]] = Partition(
            name=rec["PartitionName"],
            state=rec.get("State", "UP"),
            max_time_s=parse_time_s(rec.get("MaxTime", "UNLIMITED")),
            max_nodes=int(max_nodes) if max_nodes.isdigit() else None,
        )
    nodes = tuple(
        Node(
            name=rec["NodeName"],
            cpus=int(rec.get("CPUTot", "0")),
            memory_mb=int(rec.get("RealMemory", "0")),
            gpus=_gpus(rec.get("Gres", "(null)")),
            partitions=tuple(p for p in rec.get("Partitions", "").split(",") if p),
            state=rec.get("State", "UNKNOWN"),
            address=rec.get("NodeAddr", rec["NodeName"]),
        )
        for rec in parse_records(node_text)
    )
    return Inventory(partitions, nodes)


def require_slurm(env: Mapping[str, str]) -> None:
    missing = [cmd for cmd in ("sbatch", "srun", "scontrol") if shutil.which(cmd, path=env.get("PATH")) is None]
    if missing:
        raise SlurmPreflightError(
            f"no Slurm on the PATH ({', '.join(missing)} not found). Run from a login node of a Slurm cluster, "
            "or use cluster=local to run on this machine. For a local test cluster: install Slurm (as root, "
            "`bash tools/setup_env.sh` does it on Debian), then `bash slurm/cluster.sh start` and export the "
            "SLURM_CONF it prints."
        )


def read_inventory(env: Mapping[str, str]) -> Inventory:
    require_slurm(env)
    texts = []
    for what in ("partition", "node"):
        proc = subprocess.run(
            ["scontrol", "show", what, "-o"], capture_output=True, text=True, env=dict(env), timeout=30
        )
        if proc.returncode != 0:
            raise SlurmPreflightError(
                f"`scontrol show {what}` failed: {proc.stderr.strip()}. Is slurmctld reachable? Check SLURM_CONF "
                f"(now {env.get('SLURM_CONF', 'unset')}); for the local test cluster: `bash slurm/cluster.sh status`."
            )
        texts.append(proc.stdout)
    return parse_inventory(*texts)


def _fits(node: Node, res: CellResources) -> bool:
    mem = parse_mem_mb(res.mem) if res.mem else 0
    return node.cpus >= res.cpus_per_node and node.gpus >= res.gpus_per_node and node.memory_mb >= mem


def check_request(cells: list[CellResources], inv: Inventory) -> None:
    """Raise SlurmPreflightError if the cluster cannot run one component per cell."""
    names = ", ".join(sorted(inv.partitions)) or "none"
    for cell, res in enumerate(cells):
        key = cell_key(cell)
        part = inv.partitions.get(res.partition)
        if part is None:
            raise SlurmPreflightError(
                f"{key}.partition={res.partition!r}: this cluster has no such partition (it has: {names}). "
                f"Set {key}.partition to one of them."
            )
        if part.state != "UP":
            raise SlurmPreflightError(f"partition {part.name!r} of {key} is {part.state}, not UP; choose another")
        wanted_s, limit_s = parse_time_s(res.time), part.max_time_s
        if limit_s is not None and (wanted_s is None or wanted_s > limit_s):
            raise SlurmPreflightError(
                f"{key}.time={res.time} exceeds the MaxTime of partition {part.name!r} ({limit_s} s); lower it"
            )
        if part.max_nodes is not None and res.nodes > part.max_nodes:
            raise SlurmPreflightError(
                f"{key}.nodes={res.nodes} exceeds MaxNodes={part.max_nodes} of partition {part.name!r}; lower it"
            )
        members = inv.nodes_of(res.partition)
        fitting = [n for n in members if _fits(n, res)]
        if len(fitting) < res.nodes:
            largest = max(members, key=lambda n: (n.gpus, n.cpus, n.memory_mb), default=None)
            biggest = (
                f"; its largest node has {largest.cpus} CPUs, {largest.gpus} GPUs, {largest.memory_mb} MB"
                if largest
                else ""
            )
            raise SlurmPreflightError(
                f"{key} asks for {res.nodes} node(s) with {res.cpus_per_node} CPUs, {res.gpus_per_node} GPUs"
                f"{', ' + res.mem + ' memory' if res.mem else ''} each; partition {part.name!r} has {len(fitting)} "
                f"such node(s) of {len(members)} usable{biggest}. Lower {key}.nodes/cpus_per_node/gpus_per_node/mem "
                "or choose a larger partition."
            )
    usable = sorted({n.name for res in cells for n in inv.nodes_of(res.partition) if _fits(n, res)})
    needed = sum(res.nodes for res in cells)
    if len(cells) > 1 and len(usable) < needed:
        single = (
            f"this cluster offers a single node ({usable[0]})"
            if len(usable) == 1
            else f"only {len(usable)} nodes fit the cells' requests"
        )
        raise SlurmPreflightError(
            f"a heterogeneous job of {len(cells)} cells needs {needed} distinct nodes (Slurm puts each component on "
            f"its own nodes, and on too few nodes the job pends forever), but {single}. On one machine use "
            "cluster=local; for a local multi-node test cluster run `bash slurm/cluster.sh start --nodes 3`; "
            "or use fewer satellites/nodes (cluster.satellites)."
        )


def check_addresses(comm_hostname: str, engine_host: str, cells: list[CellResources], inv: Inventory) -> None:
    """Refuse loopback addresses before submitting when the cells' nodes are separate hosts (their NodeAddr
    differ): a rank advertising 127.0.0.1, or an engine bound there, cannot be reached from another node.
    The job's own preflight checks what each node resolves (gyre/sched/launch/job_preflight.py)."""
    addresses = {n.address for res in cells for n in inv.nodes_of(res.partition)}
    if len(addresses) < 2 or all(is_loopback(a) for a in addresses):
        return  # one host (the loopback test cluster), or nothing to tell
    problems = []
    if is_loopback(comm_hostname):
        problems.append(f"comm.hostname={comm_hostname!r}: set comm.hostname=auto (each node advertises its address)")
    if is_loopback(engine_host):
        problems.append(f"engine.host={engine_host!r}: set engine.host=0.0.0.0 (engines advertised at comm.hostname)")
    if problems:
        raise SlurmPreflightError(
            f"the cells run on separate hosts (NodeAddr {', '.join(sorted(addresses))}), where a loopback "
            "address cannot be reached from another node: " + "; ".join(problems)
        )
