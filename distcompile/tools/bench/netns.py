"""Network namespaces as nodes, optionally rate-limited: real links on one machine.

Two nodes are joined by a veth pair (``veth_pair``); more hang on a switch (``star``: a
bridge in a namespace of its own, a veth pair to each node, both directions of each
node's port shaped, as a switch with ports of that rate). Used by the benchmark (shaped
1 Gbit/s or 200 Mbit/s links) and by the multi-node test. Only the namespaces' own
addresses are used, and everything is deleted on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["VethPair", "can_make_namespaces", "star", "veth_pair"]


@dataclass(frozen=True, slots=True)
class VethPair:
    """Attributes: ``namespaces``, ``devices`` and ``addresses`` of the nodes, in order (two
    for a pair, one per node for a ``star``)."""

    namespaces: tuple[str, ...]
    devices: tuple[str, ...]
    addresses: tuple[str, ...]


def can_make_namespaces() -> str | None:
    """``None`` if this process can create namespaces, else the reason it cannot.

    Example:
        >>> isinstance(can_make_namespaces(), (str, type(None)))
        True
    """
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} from iproute2 (apt-get install iproute2)"
    return None


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _shape(ns: str, dev: str, rate: str) -> None:
    # Token bucket: the rate, a burst, queueing bounded by latency. The burst is 256 KB for
    # every rate: with 64 KB at 200 Mbit/s the kernel throttled 25x more often (tc
    # overlimits 153k vs 6k for 85 MB), spent 1.4 s of softirq instead of 0.07 s and slowed
    # a compute thread by ~45%, for the same measured bandwidth (4 x 21.2 MB all-reduced in
    # 3.60 vs 3.55 s).
    _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
        "burst", "256kb", "latency", "100ms")  # fmt: skip


@contextlib.contextmanager
def veth_pair(subnet: str, *, rate: str | None = None) -> Iterator[VethPair]:
    """Create the pair (addresses ``{subnet}.1`` and ``{subnet}.2``), shape both ends to ``rate``.

    ``rate`` is a ``tc`` rate such as ``"1gbit"`` (token bucket filter); ``None`` leaves the
    link unshaped. Raises ``subprocess.CalledProcessError`` if a step fails (after removing
    what it created).

    Example:
        >>> # with veth_pair("10.213.9", rate="1gbit") as link:
        >>> #     subprocess.run(["ip", "netns", "exec", link.namespaces[0], "ping", "-c1", link.addresses[1]])
    """
    tag = uuid.uuid4().hex[:6]
    pair = VethPair((f"dc{tag}a", f"dc{tag}b"), (f"dc{tag}0", f"dc{tag}1"), (f"{subnet}.1", f"{subnet}.2"))
    made: list[str] = []
    try:
        for ns in pair.namespaces:
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        _sh("ip", "link", "add", pair.devices[0], "type", "veth", "peer", "name", pair.devices[1])
        for ns, dev, addr in zip(pair.namespaces, pair.devices, pair.addresses):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if rate:
                _shape(ns, dev, rate)
        yield pair
    finally:
        for ns in made:  # deleting a namespace also deletes its end of the veth pair, so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@contextlib.contextmanager
def star(subnet: str, nodes: int, *, rate: str | None = None) -> Iterator[VethPair]:
    """``nodes`` namespaces (addresses ``{subnet}.1`` ...) on one switch, each port shaped to ``rate``.

    Yields a ``VethPair`` whose fields hold one entry per node (the node's namespace, its
    device and address). Raises ``subprocess.CalledProcessError`` if a step fails (after
    removing what it created).

    Example:
        >>> # with star("10.213.12", 4, rate="1gbit") as net:   # 4 nodes on a 1 Gbit/s switch
        >>> #     print(net.namespaces, net.addresses)
    """
    tag = uuid.uuid4().hex[:6]
    hub = f"dc{tag}s"
    net = VethPair(
        tuple(f"dc{tag}n{i}" for i in range(nodes)),
        tuple(f"dc{tag}{i}" for i in range(nodes)),
        tuple(f"{subnet}.{i + 1}" for i in range(nodes)),
    )
    made: list[str] = []
    try:
        for ns in (hub, *net.namespaces):
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        _sh("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", hub, "link", "set", "br0", "up")
        for i, (ns, dev, addr) in enumerate(zip(net.namespaces, net.devices, net.addresses)):
            port = f"dc{tag}p{i}"
            _sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "link", "set", port, "netns", hub)
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            for n, d in ((ns, dev), (ns, "lo"), (hub, port)):
                _sh("ip", "-n", n, "link", "set", d, "up")
            _sh("ip", "-n", hub, "link", "set", port, "master", "br0")
            if rate:
                _shape(ns, dev, rate)
                _shape(hub, port, rate)
        yield net
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
