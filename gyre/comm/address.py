"""The address a rank advertises to the others (its engine's URL, its Mooncake session, gloo), resolved
once on its own node, and the check that what every rank advertises can be reached from the others.

`comm.hostname` is an address or host name, or "auto": this node's host name resolved here, or with
`comm.interface` the address of that network interface. A loopback address is fine while every rank
shares one host (one kernel and one network namespace: `host_identity`), and useless once the ranks
span several: Debian's `127.0.1.1 <hostname>` line in /etc/hosts is the usual way to get one by accident.
"""

from __future__ import annotations

import fcntl
import http.client
import ipaddress
import os
import socket
import struct
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

AUTO = "auto"
_SIOCGIFADDR = 0x8915


class AddressError(RuntimeError):
    """No address the other ranks can reach; the message names the key to set."""


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def is_wildcard(address: str) -> bool:
    return address in ("0.0.0.0", "::", "")


def host_identity() -> str:
    """Equal for two processes iff they share a kernel and a network namespace (loopback reaches between them)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        return socket.gethostname()
    return f"{boot}/{netns}"


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` (e.g. eth0, ib0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            names = ", ".join(n for _, n in socket.if_nameindex())
            raise AddressError(
                f"comm.interface={name!r}: no IPv4 address on that interface of {socket.gethostname()} ({e}); "
                f"interfaces here: {names}"
            ) from e
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The interface holding `address` on this host (None when none does, or for IPv6)."""
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except AddressError:
            continue
    return None


def _resolve(name: str, key: str) -> str:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as e:
        raise AddressError(
            f"{key}: cannot resolve {name!r} on {socket.gethostname()} ({e}); set comm.hostname to this node's "
            "address, or comm.hostname=auto with comm.interface=<NIC>"
        ) from e
    found = list(dict.fromkeys(info[4][0] for info in infos))
    reachable = [a for a in found if not is_loopback(a)]
    return (reachable or found)[0]


def advertise_address(hostname: str, interface: str = "") -> str:
    """`comm.hostname` as a concrete address of this host: never the placeholder "auto", never a name."""
    if hostname == AUTO:
        if interface:
            return interface_address(interface)
        return _resolve(socket.gethostname(), f"comm.hostname=auto (host name {socket.gethostname()!r})")
    try:
        return str(ipaddress.ip_address(hostname))
    except ValueError:
        return _resolve(hostname, f"comm.hostname={hostname!r}")


def is_local_address(address: str) -> bool:
    """Whether a socket can bind `address` here (the address belongs to this host)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True


@dataclass(frozen=True)
class RankAddress:
    rank: int
    where: str  # for messages: "cell 1 on node2"
    address: str  # what it advertises (comm.hostname resolved)
    host: str  # host_identity()
    hostname: str  # socket.gethostname()
    local: bool  # the address is one of this host's


def this_rank(rank: int, where: str, address: str) -> RankAddress:
    return RankAddress(rank, where, address, host_identity(), socket.gethostname(), is_local_address(address))


def check_reachable(ranks: Sequence[RankAddress], hostname_key: str, engine_host: str) -> None:
    """Refuse, before anything starts, addresses the other ranks cannot reach: not this host's, loopback
    (comm.hostname, or engines bound to loopback by engine.host) once the ranks span several hosts, or one
    address claimed by several hosts. Every rank runs it on the same list and reaches the same verdict."""
    problems = [
        f"{r.where} (rank {r.rank}): comm.hostname={hostname_key!r} resolved to {r.address}, which is not an "
        f"address of its host {r.hostname}; set comm.hostname=auto"
        for r in ranks
        if not r.local
    ]
    hosts = {r.host for r in ranks}
    if len(hosts) > 1:
        for r in ranks:
            if is_loopback(r.address):
                why = (
                    f"its host name {r.hostname} resolves to the loopback address {r.address} there (a Debian-style "
                    f"'127.0.1.1 {r.hostname}' line in /etc/hosts?); set comm.interface=<its NIC, e.g. eth0> with "
                    "comm.hostname=auto, or make the name resolve to the node's address"
                    if hostname_key == AUTO
                    else f"comm.hostname={hostname_key!r} is a loopback address; set comm.hostname=auto"
                )
                problems.append(f"{r.where} (rank {r.rank}) would advertise {r.address}: {why}")
        claimed: dict[str, set[str]] = {}
        for r in ranks:
            claimed.setdefault(r.address, set()).add(r.host)
        for address, on in claimed.items():
            if len(on) > 1 and not is_loopback(address):
                problems.append(
                    f"{len(on)} hosts advertise the same address {address} (comm.hostname={hostname_key!r}); "
                    "set comm.hostname=auto so each node advertises its own"
                )
        if is_loopback(engine_host):
            problems.append(
                f"engine.host={engine_host!r} binds every engine to loopback, where the controller on another host "
                "cannot reach it; set engine.host=0.0.0.0 (engines are then advertised at comm.hostname)"
            )
    if problems:
        span = f"{len(hosts)} hosts" if len(hosts) > 1 else "one host"
        raise AddressError(
            f"the job's ranks span {span} and some cannot be reached by the others:\n  " + "\n  ".join(problems)
        )


def engine_reachable(url: str, timeout_s: float) -> str:
    """Empty once `url` answers HTTP at all (any status: the port is the engine's), else the last error."""
    parts = urllib.parse.urlsplit(url)
    deadline, error = time.monotonic() + timeout_s, "not tried"
    while True:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=min(3.0, timeout_s))
        try:
            conn.request("GET", "/health")
            conn.getresponse().read()
            return ""
        except (OSError, http.client.HTTPException) as e:
            error = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        if time.monotonic() > deadline:
            return error
        time.sleep(0.5)
