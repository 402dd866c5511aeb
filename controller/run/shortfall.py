"""How long a run's fleet has had fewer nodes than it keeps, and what it waits for: what the
live view's frame (``controller/view/collect.py``) and the plain lines (``drive.PlainLines``)
both say of a short fleet, read from the controller's hash and the launch ledger."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from spottrain.controller.reconcile.records import Ledger
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import Summary
from spottrain.protocol.states import LedgerStatus, RunPhase

# The ledger (one record per launch: thousands on a big fleet) is read again for the last
# refusal at most this often while the fleet is short.
LEDGER_EVERY_S = 10.0


def duration(seconds: float) -> str:
    """``3m05s``, or ``2h07m`` from an hour on."""
    s = max(0, int(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


@dataclass(frozen=True)
class Shortfall:
    """A fleet short of nodes: ``have`` of ``target`` for ``seconds``; ``refusal``: the
    newest launch the cloud refused (``<type> <market> in <zone>: <reason>``), if any."""

    have: int
    target: int
    seconds: float
    refusal: str = ""

    def line(self) -> str:
        """``fleet short: 1 of 2 nodes for 3m05s, waiting for capacity; last refusal: ...``"""
        why = f"; last refusal: {self.refusal}" if self.refusal else ""
        return (
            f"fleet short: {self.have} of {self.target} nodes for "
            f"{duration(self.seconds)}, waiting for capacity{why}"
        )


class LedgerCache:
    """The run's launch ledger as last read, read again at most every :data:`LEDGER_EVERY_S`
    (or when forced: a node the reader has not placed appeared)."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self._read_at = float("-inf")

    def read(self, state: RunState, now: float, *, force: bool = False) -> Ledger:
        if force or now - self._read_at >= LEDGER_EVERY_S:
            self.ledger, self._read_at = state.ledger(), now
        return self.ledger


def last_refusal(ledger: Ledger) -> str:
    """The newest failed launch of ``ledger``, as :class:`Shortfall` says it ("" if none)."""
    refused = [r for r in ledger.records.values() if r.status == LedgerStatus.FAILED]
    if not refused:
        return ""
    last = max(refused, key=lambda r: r.launched_at)
    o = last.offer
    return f"{o.instance_type} {o.market.value} in {o.zone}: {last.reason}"


class ShortWatch:
    """Whether the fleet is short, pass after pass (it keeps when it was first seen short).

    Args:
        target: the nodes the run keeps when ``spottrain scale`` set none (``nodes.max``).
    """

    def __init__(self, target: int) -> None:
        self.target = target
        self._since: float | None = None

    def check(
        self, now: float, s: Summary, ctl: Mapping[str, str], ledger: Callable[[], Ledger]
    ) -> Shortfall | None:
        """The shortfall of now, or None while the fleet is whole (or the run not running).

        ``ctl``: the controller's hash (``target_nodes``, ``spot_short_since``, which dates
        the shortfall from the first capacity refusal when there was one); ``ledger`` is read
        only when the fleet is short.
        """
        wanted = _float(ctl.get("target_nodes"))
        target = int(wanted) if wanted is not None else self.target
        if s.phase != RunPhase.RUNNING or ctl.get("stopping") or len(s.nodes) >= target:
            self._since = None
            return None
        if self._since is None:
            self._since = now
        since = _float(ctl.get("spot_short_since")) or self._since
        return Shortfall(len(s.nodes), target, now - since, last_refusal(ledger()))


def _float(v: str | None) -> float | None:
    try:
        return float(v) if v else None
    except ValueError:
        return None
