"""What one collective costs on a link: the alpha-beta model of ring algorithms, flat or in two levels,
and the links the lab knows by name. A leaf: the emulated network (trainer/sync/network.py) and the
scaling model (trainer/scaling/) both read it.

A ring of n ranks moves a buffer of S bytes in steps of S/n per rank (the step counts are
trainer/comm_math.py's ring_steps). Each step pays the link's latency alpha plus S/n bytes at its
bandwidth beta:

    all_reduce      2(n-1) (alpha + S / (n beta))
    reduce_scatter   (n-1) (alpha + S / (n beta))     S = the full input
    all_gather       (n-1) (alpha + S / (n beta))     S = the full output

beta is per rank and direction, which is what nccl-tests' bus bandwidth measures. A collective is
charged by the ranks of its group: inside one node it is a ring on the intra-node link; a group that
spans nodes is one flat ring whose every step waits for its slowest hop, the inter-node link (a
single ring, as gloo runs and as nccl-tests' bus bandwidth across nodes shows). The two-level form
(NCCL's tree, Horovod's and sync=hierarchical's: reduce-scatter inside each node on the whole
buffer, all-reduce across nodes on each rank's 1/G of it, every NIC at once, all-gather inside the
node) is `two_level_s`: three collectives on two kinds of group, not one flat ring.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from trainer.comm_math import ring_steps

KINDS = ("all_reduce", "reduce_scatter", "all_gather")  # the ones a fit has a link for
Span = Literal["world", "node", "nodes"]  # where a collective's group lies (Topology.span)


@dataclass(frozen=True)
class Link:
    """One kind of collective's latency (s per ring step) and bandwidth (bytes/s per rank)."""

    alpha_s: float
    beta_Bps: float

    def __post_init__(self) -> None:
        if self.alpha_s < 0 or self.beta_Bps <= 0:
            raise ValueError(f"need alpha >= 0 s and beta > 0 B/s, got alpha={self.alpha_s}, beta={self.beta_Bps}")


@dataclass(frozen=True)
class Network:
    """A link per collective kind: a preset uses one for all three; a fit has its own for each."""

    name: str
    links: dict[str, Link]

    @classmethod
    def uniform(cls, name: str, alpha_s: float, beta_Bps: float) -> Network:
        return cls(name, dict.fromkeys(KINDS, Link(alpha_s, beta_Bps)))

    def link(self, kind: str) -> Link:
        return self.links[kind]

    def describe(self) -> str:
        if len(set(self.links.values())) == 1:
            link = self.links[KINDS[0]]
            return f"{self.name} (alpha {link.alpha_s * 1e6:g} us, beta {link.beta_Bps / 1e9:g} GB/s)"
        parts = [f"{k} {v.alpha_s * 1e6:.3g} us, {v.beta_Bps / 1e9:.3g} GB/s" for k, v in self.links.items()]
        return f"{self.name} ({'; '.join(parts)})"


def ring_s(kind: str, size_bytes: float, n: int, link: Link) -> float:
    """One flat ring collective of size_bytes over n ranks; 0 for a single rank."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {', '.join(KINDS)}")
    if n <= 1 or size_bytes <= 0:
        return 0.0
    return ring_steps(kind, n) * (link.alpha_s + size_bytes / (n * link.beta_Bps))


@dataclass(frozen=True)
class Topology:
    """ranks spread over nodes of ranks_per_node; intra connects a node's ranks, inter the nodes."""

    ranks: int
    ranks_per_node: int
    intra: Network
    inter: Network

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.ranks_per_node < 1:
            raise ValueError(f"need ranks >= 1 and ranks per node >= 1, got {self.ranks} and {self.ranks_per_node}")
        if self.ranks > self.ranks_per_node and self.ranks % self.ranks_per_node:
            raise ValueError(
                f"{self.ranks} ranks do not fill nodes of {self.ranks_per_node}: "
                f"use a multiple of {self.ranks_per_node}"
            )

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.ranks_per_node)

    @property
    def per_node(self) -> int:
        return min(self.ranks, self.ranks_per_node)

    def span(self, name: Span) -> list[int]:
        """The ranks of a group by where it lies: `world` every rank, `node` the first node's ranks,
        `nodes` one rank of each node (the group an inter-node all-reduce of a shard runs on)."""
        if name == "node":
            return list(range(self.per_node))
        if name == "nodes":
            return list(range(0, self.ranks, self.per_node))
        return list(range(self.ranks))

    def group_s(self, kind: str, size_bytes: float, ranks: Sequence[int]) -> float:
        """One flat ring collective of size_bytes over these ranks: on the intra link if they all lie in
        one node, else on the inter link (the ring's slowest hop sets every step's pace)."""
        nodes = {rank // self.ranks_per_node for rank in ranks}
        network = self.intra if len(nodes) == 1 else self.inter
        return ring_s(kind, size_bytes, len(ranks), network.link(kind))

    def collective_s(self, kind: str, size_bytes: float, span: Span = "world") -> float:
        """Seconds for one collective of size_bytes (all_reduce's buffer, reduce_scatter's input,
        all_gather's output) on the group `span` names (by default every rank, one flat ring)."""
        return self.group_s(kind, size_bytes, self.span(span))

    def two_level_s(self, kind: str, size_bytes: float) -> float:
        """The same collective over every rank in two levels: inside each node on the whole buffer, across
        nodes on each rank's 1/G of it (sync=hierarchical's steps; one flat ring inside a single node)."""
        if self.nodes == 1:
            return self.collective_s(kind, size_bytes)
        local_rs = self.collective_s("reduce_scatter", size_bytes, "node")
        local_ag = self.collective_s("all_gather", size_bytes, "node")
        across = self.collective_s(kind, size_bytes / self.per_node, "nodes")  # each rank's 1/g, all NICs at once
        if kind == "all_reduce":
            return local_rs + across + local_ag
        return local_rs + across if kind == "reduce_scatter" else across + local_ag


# alpha: latency per ring step; beta: bytes/s per rank and direction actually reached (a fraction of
# the nominal rate, as nccl-tests' bus bandwidth shows). Sources and reasoning are in docs/scaling.md
# ("Scaling beyond this machine"). loopback is this repository's 2-core build machine, fitted by
# fit_network() from its collective benchmark (2 gloo ranks, float32, 4 KiB to 16 MiB): gloo runs
# reduce_scatter as a full all_reduce, so each kind has its own link there.
PRESETS: dict[str, Network] = {
    "loopback": Network(
        "loopback",
        {
            "all_reduce": Link(alpha_s=1.0e-3, beta_Bps=0.93e9),
            "reduce_scatter": Link(alpha_s=1.8e-3, beta_Bps=0.24e9),
            "all_gather": Link(alpha_s=1.0e-3, beta_Bps=0.39e9),
        },
    ),
    "nvlink": Network.uniform("nvlink", alpha_s=2e-6, beta_Bps=360e9),  # NVLink 4 (H100 SXM): 450 GB/s each way
    "ib-ndr400": Network.uniform("ib-ndr400", alpha_s=5e-6, beta_Bps=45e9),  # 400 Gb/s = 50 GB/s per NIC
    "100gbe": Network.uniform("100gbe", alpha_s=15e-6, beta_Bps=10e9),  # 100 Gb/s = 12.5 GB/s, RoCE or TCP
    "10gbe": Network.uniform("10gbe", alpha_s=25e-6, beta_Bps=1.1e9),  # 10 Gb/s = 1.25 GB/s, TCP
    "1gbe": Network.uniform("1gbe", alpha_s=50e-6, beta_Bps=0.11e9),  # 1 Gb/s = 125 MB/s, TCP
}
# The presets network=<name> emulates (conf/network/): every one above but loopback, which is this
# machine's measured gloo (emulating it on top of itself would count it twice).
Preset = Literal["nvlink", "ib-ndr400", "100gbe", "10gbe", "1gbe"]
EMULATED: tuple[str, ...] = typing.get_args(Preset)
