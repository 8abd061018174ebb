"""One training job of a chaos run: the example GPT on N "nodes" (network namespaces on a
switch), each node a ``launchers/multinode.sh`` (torchrun, c10d rendezvous, restarts
allowed) with its own compile cache folder and event log; the checkpoints in one folder,
as on a shared filesystem.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from .inject import NODE_ENV, RUN_ENV

__all__ = ["Job", "checkout_root", "digests"]


def checkout_root() -> str:
    """The distcompile checkout this harness lives in (``benchmarks/chaos``; it holds ``launchers/``
    and ``examples/``).

    Example:
        >>> os.path.isdir(os.path.join(checkout_root(), "distcompile"))
        True
    """
    return os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 2))


def digests(text: str) -> dict[int, str]:
    """rank -> final parameter digest, from the example's last lines.

    Example:
        >>> digests("rank 1 final parameter digest 3.5\\nrank 0 final parameter digest 3.5")
        {1: '3.5', 0: '3.5'}
    """
    return {int(r): d for r, d in re.findall(r"rank (\d+) final parameter digest (\S+)", text)}


@dataclass
class Job:
    """Attributes: ``tag`` (marks every process of it), ``root`` (its folders), the network
    (``namespaces``, ``devices``, ``addresses``: one per node), ``ranks_per_node``, ``steps``,
    ``ckpt_every``, ``max_restarts`` and the model's ``train_args``."""

    tag: str
    root: str
    namespaces: tuple[str, ...]
    devices: tuple[str, ...]
    addresses: tuple[str, ...]
    ranks_per_node: int
    steps: int
    ckpt_every: int
    max_restarts: int
    train_args: tuple[str, ...] = ("--n-layer", "2", "--n-embd", "64")
    port: int = 29541

    @property
    def nodes(self) -> int:
        return len(self.namespaces)

    def cache(self, node: int) -> str:
        return os.path.join(self.root, f"node{node}", "inductor")

    def events(self, node: int) -> str:
        return os.path.join(self.root, f"node{node}", "events.jsonl")

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.root, "ckpt")

    def output(self, node: int) -> str:
        return os.path.join(self.root, f"node{node}", "output.log")

    def start(self) -> list[subprocess.Popen]:
        """Start every node's launcher (output to ``output(node)``)."""
        ckout = checkout_root()
        launcher = os.path.join(ckout, "launchers", "multinode.sh")
        script = os.path.join(ckout, "examples", "train_gpt.py")
        if not (os.path.exists(launcher) and os.path.exists(script)):
            raise SystemExit(
                f"the chaos run needs a checkout of distcompile ({launcher} and {script} not found)"
            )
        train = [script, "--distcompile", *self.train_args, "--steps", str(self.steps)]
        train += ["--ckpt-dir", self.ckpt_dir, "--ckpt-every", str(self.ckpt_every)]
        procs = []
        for node, (ns, dev, addr) in enumerate(zip(self.namespaces, self.devices, self.addresses)):
            os.makedirs(self.cache(node), exist_ok=True)
            env = dict(
                os.environ,
                PYTHONPATH=os.pathsep.join([ckout, os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1",
                PYTHONUNBUFFERED="1",
                NNODES=str(self.nodes),
                NPROC=str(self.ranks_per_node),
                RDZV_ENDPOINT=f"{self.addresses[0]}:{self.port}",
                RDZV_ID=self.tag,
                RDZV_CONF=f"is_host={int(node == 0)}",
                LOCAL_ADDR=addr,
                GLOO_SOCKET_IFNAME=dev,
                MAX_RESTARTS=str(self.max_restarts),
                TORCHINDUCTOR_CACHE_DIR=self.cache(node),
                DISTCOMPILE_EVENTS=self.events(node),
                **{RUN_ENV: self.tag, NODE_ENV: str(node)},
            )
            out = open(self.output(node), "w")  # noqa: SIM115 - the launcher writes it until it exits
            procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, launcher, *train],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=self.root,
                    start_new_session=True,
                )
            )
            out.close()
        return procs

    def summary(self, node: int) -> str:
        """The launcher's summary at the end of ``node``'s output (``distcompile._events.summary``)."""
        try:
            with open(self.output(node)) as f:
                text = f.read()
        except OSError:
            return ""
        at = text.rfind("distcompile: ")
        return text[at:].strip() if at >= 0 and " of the process group" in text[at:] else ""

    def outputs(self) -> str:
        """Every node's output, one after the other."""
        parts = []
        for node in range(self.nodes):
            try:
                with open(self.output(node)) as f:
                    parts.append(f"=== node {node}\n{f.read()}")
            except OSError:
                parts.append(f"=== node {node}: no output")
        return "\n".join(parts)
