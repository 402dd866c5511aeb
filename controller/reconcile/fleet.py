"""The fleet as the planner sorts it: nodes that can need something, looked at one by one,
and settled nodes, only counted. :class:`FleetIndex` keeps that sort up to date as nodes
change one at a time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, overload

from spottrain.cloud.base import InstanceState
from spottrain.protocol.states import NodeState

from .types import NodeObs, Policy

_K = TypeVar("_K", float, str)


def is_alive(n: NodeObs) -> bool:
    return n.instance is None or n.instance.state.alive


def is_lost(n: NodeObs, now: float, policy: Policy) -> bool:
    if n.instance is None:
        return now - n.launched_at > policy.lost_grace_s
    return not n.instance.state.alive


# Agent states after which a node needs a look each pass (a timeout, an end, a replacement).
_WATCHED_AGENT_STATES = (NodeState.BOOTING, NodeState.FAILED, NodeState.LEFT, NodeState.DRAINING)


def is_settled(n: NodeObs) -> bool:
    """A node no rule can act on whatever the clock says: listed and alive (not stopping),
    its agent registered and neither booting, failed, left nor draining, its health not
    failed, not at risk nor a replacement for one. Such a node only counts (staying, its
    price, its zone); a straggler check, which looks at compute times, is the one rule that
    reads it, and it reads the whole fleet."""
    inst = n.instance
    return (
        inst is not None
        and (inst.state is InstanceState.RUNNING or inst.state is InstanceState.PENDING)
        and not n.health_failed
        and not n.at_risk
        and not n.replaces
        and n.agent_state is not None
        and n.agent_state not in _WATCHED_AGENT_STATES
    )


@dataclass
class Tally:
    """The nodes sorted for a pass: the ones to look at (in fleet order) and counts of the
    settled rest."""

    unsettled: list[NodeObs]
    settled: int
    prices: Counter[float]  # price per hour -> settled nodes with an offer at that price
    zones: Counter[str]  # zone -> settled nodes with an offer there
    timed: int  # nodes (of either kind) that report a compute time
    # Nodes (of either kind) that train (NodeObs.trains: in a round, for a while).
    training: int = 0

    @classmethod
    def of(cls, nodes: Iterable[NodeObs]) -> Tally:
        unsettled: list[NodeObs] = []
        prices: Counter[float] = Counter()
        zones: Counter[str] = Counter()
        settled = timed = training = 0
        for n in nodes:
            if n.compute_s is not None:
                timed += 1
            if n.trains:
                training += 1
            if is_settled(n):
                settled += 1
                if n.offer is not None:
                    prices[n.offer.price_per_hour] += 1
                    zones[n.offer.zone] += 1
            else:
                unsettled.append(n)
        return cls(unsettled, settled, prices, zones, timed, training)


class FleetIndex(Sequence[NodeObs]):
    """The observed nodes by name, kept sorted for :func:`plan` as they change.

    Pass it as ``Observed.nodes``: it is a sequence of the nodes (in the order they were
    first put), and ``plan`` reads its running counts instead of scanning every node, so a
    pass costs in proportion to the nodes that are booting, draining, failed or otherwise
    unsettled, not to the fleet. ``put`` adds or replaces a node (a replaced node keeps its
    place), ``remove`` drops one; neither copies the fleet.
    """

    def __init__(self, nodes: Iterable[NodeObs] = ()) -> None:
        self._nodes: dict[str, NodeObs] = {}
        self._order: dict[str, int] = {}
        self._next = 0
        self._unsettled: dict[str, NodeObs] = {}
        self._settled = 0
        self._prices: Counter[float] = Counter()
        self._zones: Counter[str] = Counter()
        self._timed = 0
        self._training = 0
        self._list: list[NodeObs] | None = None
        for n in nodes:
            self.put(n)

    def put(self, node: NodeObs) -> None:
        """Add ``node``, or replace the node of the same name."""
        old = self._nodes.get(node.name)
        if old is not None:
            self._uncount(old)
        else:
            self._order[node.name] = self._next
            self._next += 1
        self._nodes[node.name] = node
        self._count(node)
        self._list = None

    def remove(self, name: str) -> NodeObs | None:
        """Drop the node called ``name``; returns it (None when there was none)."""
        old = self._nodes.pop(name, None)
        if old is not None:
            self._uncount(old)
            del self._order[name]
            self._list = None
        return old

    def get(self, name: str) -> NodeObs | None:
        return self._nodes.get(name)

    def _count(self, n: NodeObs) -> None:
        if n.compute_s is not None:
            self._timed += 1
        if n.trains:
            self._training += 1
        if is_settled(n):
            self._settled += 1
            if n.offer is not None:
                self._prices[n.offer.price_per_hour] += 1
                self._zones[n.offer.zone] += 1
        else:
            self._unsettled[n.name] = n

    def _uncount(self, n: NodeObs) -> None:
        if n.compute_s is not None:
            self._timed -= 1
        if n.trains:
            self._training -= 1
        if self._unsettled.pop(n.name, None) is None:
            self._settled -= 1
            if n.offer is not None:
                decrement(self._prices, n.offer.price_per_hour)
                decrement(self._zones, n.offer.zone)

    def tally(self) -> Tally:
        order = self._order
        unsettled = sorted(self._unsettled.values(), key=lambda n: order[n.name])
        return Tally(
            unsettled,
            self._settled,
            Counter(self._prices),
            Counter(self._zones),
            self._timed,
            self._training,
        )

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeObs]:
        return iter(self._nodes.values())

    def __contains__(self, value: object) -> bool:
        return isinstance(value, NodeObs) and self._nodes.get(value.name) == value

    @overload
    def __getitem__(self, i: int) -> NodeObs: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[NodeObs]: ...

    def __getitem__(self, i: int | slice) -> NodeObs | Sequence[NodeObs]:
        if self._list is None:
            self._list = list(self._nodes.values())
        return self._list[i]


def decrement(counter: Counter[_K], key: _K) -> None:
    left = counter[key] - 1
    if left:
        counter[key] = left
    else:
        del counter[key]


def majority_home(nodes: Sequence[NodeObs]) -> tuple[str, str, str] | None:
    counts = Counter(
        (n.offer.cloud, n.offer.zone, n.offer.instance_type) for n in nodes if n.offer is not None
    )
    return counts.most_common(1)[0][0] if counts else None
