"""Another host, simulated on this one: a Linux network namespace of the test's own, joined to the root
namespace by a veth pair with addresses the test chooses (10.231.X.1 on the host side, 10.231.X.2 inside).
A process started under `Netns.prefix` has its own network stack: it reaches the trainer, and is reached,
only through its veth address (its loopback is its own). It is not another kernel nor another machine:
the file system and /dev/shm stay shared, so tests must check that no shared-memory path was taken.

Names are unique per call (parallel runs do not collide); the namespace and the veth are always removed at
the end, even on failure. Without root or `ip netns` the test is skipped, saying why."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator

import pytest

SUBNET = "10.231"
"""The /16 the namespaces' /24 subnets are taken from."""


@dataclasses.dataclass(frozen=True)
class Netns:
    """A namespace of the test's own: its name, the host-side address and the address inside it."""

    name: str
    host_veth: str
    host_addr: str
    addr: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """The command that runs a program inside the namespace."""
        return ("ip", "netns", "exec", self.name)

    def url(self, port: int) -> str:
        """The http URL of `port` inside the namespace, at its veth address."""
        return f"http://{self.addr}:{port}"

    def pids(self) -> list[int]:
        """The processes running inside the namespace now."""
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False)
        return [int(p) for p in out.stdout.split()]


def _ip(*args: str) -> str:
    """Run `ip args`; raise with its stderr on failure."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def skip_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    try:
        _ip("netns", "list")
    except RuntimeError as err:
        return f"ip netns is unavailable: {err}"
    return None


def require_netns() -> None:
    """Skip the calling test, saying why, when namespaces cannot be made here."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


def _free_subnet() -> int:
    """A third octet X of SUBNET.X.0/24 that no address of the root namespace uses."""
    used = _ip("-o", "-4", "addr", "show")
    free = [x for x in range(256) if f" {SUBNET}.{x}." not in used]
    if not free:
        raise RuntimeError(f"every {SUBNET}.X.0/24 is in use")
    return random.choice(free)


def _cleanup(ns: Netns) -> None:
    """Kill what still runs in `ns` (all of it ours: the namespace is), then delete the veth and `ns`."""
    for pid in ns.pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    subprocess.run(["ip", "link", "del", ns.host_veth], capture_output=True, check=False)  # takes its peer
    subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, check=False)


@contextlib.contextmanager
def netns(tag: str = "titan") -> Iterator[Netns]:
    """A fresh namespace with its loopback up and a veth pair to the root namespace; removed at the end."""
    require_netns()
    token = secrets.token_hex(3)
    x = _free_subnet()
    ns = Netns(f"{tag}-{token}", f"tlh{token}", f"{SUBNET}.{x}.1", f"{SUBNET}.{x}.2")
    peer = f"tln{token}"
    try:
        _ip("netns", "add", ns.name)
        _ip("link", "add", ns.host_veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns.name)
        _ip("addr", "add", f"{ns.host_addr}/24", "dev", ns.host_veth)
        _ip("link", "set", ns.host_veth, "up")
        _ip("-n", ns.name, "addr", "add", f"{ns.addr}/24", "dev", peer)
        _ip("-n", ns.name, "link", "set", peer, "up")
        _ip("-n", ns.name, "link", "set", "lo", "up")
        yield ns
    finally:
        _cleanup(ns)


def namespaces() -> set[str]:
    """The names of the network namespaces on this host."""
    return {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}
