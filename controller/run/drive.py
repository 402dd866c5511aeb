"""Driving a run to its end, with a live view, and what is left when it ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from spottrain.controller.groups.controller import GroupController
from spottrain.controller.reconcile.controller import Controller
from spottrain.controller.reconcile.drive import ControllerError, drive_passes
from spottrain.controller.reconcile.state import RunState
from spottrain.controller.reconcile.summary import (
    BootLines,
    ReplicaFigures,
    Summary,
    boot_lines,
    replica_lines,
    replica_summary,
    summary_record,
)
from spottrain.controller.run.archive import archive_run
from spottrain.controller.run.lighthouse import LighthouseSupervisor
from spottrain.controller.run.records import RunError, RunInfo
from spottrain.controller.run.run_lighthouse import end_lighthouse, supervise_lighthouse
from spottrain.controller.run.run_redis import stop_embedded_redis
from spottrain.controller.run.shortfall import LedgerCache, Shortfall, ShortWatch
from spottrain.controller.run.wiring import (
    READY,
    build_controller,
    claim_run,
    lease_owner,
    record_controller,
)
from spottrain.controller.tracking import FleetTracker
from spottrain.protocol.states import RunPhase

if TYPE_CHECKING:
    from spottrain.controller.view.live import LiveView

EXIT_OK, EXIT_FAILED = 0, 1
# The plain lines say a fleet is short once it has been for this long: a node replaced
# after a preemption is short for a moment, which its block of lines says already.
SHORT_AFTER_S = 10.0


def format_summary(s: Summary, boot: BootLines | None = None) -> list[str]:
    """The live view: one line of figures, one of nodes, one per node at risk and, with
    ``boot``, per boot that failed or runs (``n3: boot failed in 'install the environment':
    pip: ...``), one of the controller's reason."""
    boot = boot or BootLines()
    loss = f"{s.loss:.3f}" if s.loss is not None else "-"
    nodes = ", ".join(f"{n} {state}" for n, state in s.nodes.items()) or "none"
    return [
        f"step {s.step}  loss {loss}  world {s.world_size}  preemptions {s.preemptions} "
        f"(steps lost {s.steps_lost})  ${s.spent_usd:,.2f} spent, ${s.saved_usd:,.2f} saved "
        "against on-demand",
        f"  nodes: {nodes}",
        *(f"  {line}" for line in s.at_risk),
        *(f"  {line}" for line in boot.lines()),
        f"  {s.phase}: {s.reason}",
    ]


class PlainLines:
    """The plain view (a pipe, a file, ``--detach``'s log): a stamped block of
    :func:`format_summary` lines when something changed (dollars always do, and a new
    failed boot), or every 30 s as a sign of life. With the run's ``state``, the VMs' boot
    lines (:func:`~spottrain.controller.reconcile.summary.boot_lines`) follow the nodes, and
    a fleet short of nodes for :data:`SHORT_AFTER_S` adds the live view's line (``fleet
    short: 1 of 2 nodes for 3m05s, waiting for capacity; last refusal: ...``) after the
    nodes: a block is printed when it appears and when it goes, and in between at the pace
    of the others.

    Args:
        view: where each line goes.
        state: the run's Redis (None until it answers); read each call when given.
        target: the nodes the run keeps when ``spottrain scale`` set none (``nodes.max``).
        clock: the wall clock the shortfall is dated by.
    """

    def __init__(
        self,
        view: Callable[[str], Any],
        state: Callable[[], RunState | None] | None = None,
        target: int = 0,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.view = view
        self._last: list[Any] = []
        self._last_at = 0.0
        self._state, self._clock = state, clock
        self._watch = ShortWatch(target)
        self._ledgers = LedgerCache()  # a big fleet's ledger is thousands of records

    def __call__(self, s: Summary) -> None:
        boot = self._boot(s)
        lines = format_summary(s, boot)
        short = self._shortfall(s)
        if short is not None:
            lines.insert(2, f"  {short.line()}")
        now = time.monotonic()
        key = [s.step // 25, s.nodes, s.preemptions, s.world_size, s.reason, s.phase]
        key.append(boot.failed)
        key.append(short.target if short is not None else None)
        if key != self._last or now - self._last_at > 30:
            stamp = time.strftime("%H:%M:%S")
            self.view(f"[{stamp}] {lines[0]}")
            for line in lines[1:]:
                self.view(f"           {line}")
            self._last, self._last_at = key, now

    def _boot(self, s: Summary) -> BootLines:
        """What the VMs say of their boot; none without a state or while its Redis does not
        answer."""
        state = self._state() if self._state is not None else None
        if state is None:
            return BootLines()
        try:
            return boot_lines(state, s)
        except redis.RedisError:
            return BootLines()

    def _shortfall(self, s: Summary) -> Shortfall | None:
        """The fleet's shortfall once it has lasted :data:`SHORT_AFTER_S`; None without a
        state or while its Redis does not answer (the pass rides that out, and says so)."""
        state = self._state() if self._state is not None else None
        if state is None:
            return None
        now = self._clock()
        try:
            short = self._watch.check(now, s, state.ctl(), lambda: self._ledgers.read(state, now))
        except redis.RedisError:
            return None
        return short if short is not None and short.seconds >= SHORT_AFTER_S else None


def final_report(s: Summary, replica: ReplicaFigures | None = None) -> list[str]:
    head = "training finished" if s.final_step is not None else f"run ended ({s.phase})"
    return [
        f"{head}: {s.reason}" if s.final_step is None else head,
        f"  steps trained          {s.final_step if s.final_step is not None else s.step}",
        f"  preemptions survived   {s.preemptions}",
        f"  steps lost             {s.steps_lost}",
        *(replica_lines(replica) if replica is not None else []),
        f"  cost                   ${s.spent_usd:,.2f} at the bundled prices "
        f"(${s.saved_usd:,.2f} saved against on-demand)",
    ]


def drive_run(
    info: RunInfo,
    *,
    view: Callable[[str], Any],
    interval_s: float = 1.0,
    policy: dict[str, float] | None = None,
    live: LiveView | None = None,
    on_claim: Callable[[str], Any] | None = None,
) -> int:
    """Run the controller of ``info`` until the run ends; keep its record; report.

    The run's lease is taken before anything is written: a run another controller (or a
    ``down``) holds is refused in one line with its records, run.json and Redis untouched.
    Once held, this process records itself in run.json (``down`` stops it by that mark).
    With a ``wandb:`` section in the spec, each pass is logged to the run's fleet run in
    wandb (:mod:`spottrain.controller.tracking`). ``live``: a terminal's live view, redrawn
    each pass (else ``view`` gets the plain lines). ``on_claim``: told
    :data:`~spottrain.controller.run.wiring.READY` once the lease is held, or the line that
    refused it (which ``view`` then does not get).

    Returns:
        0 when training finished, 1 when the run stopped before (budget, crash loop, a cloud
        or Redis refusing, another controller holding it).
    """
    owner = lease_owner()
    try:
        claimed = claim_run(info, owner)
    except RunError as e:
        if on_claim is not None:
            on_claim(str(e))
        else:
            view(f"spottrain: {e}")
        return EXIT_FAILED
    try:
        return _drive_claimed(info, owner, view, interval_s, policy, live, on_claim)
    finally:
        # Whatever stopped it (the run's end, a RunError, `down`'s SIGTERM before the passes
        # held the lease), the lease goes now, not when it lapses. Compare and delete: a
        # lease another controller took is left alone.
        with contextlib.suppress(redis.RedisError):
            claimed.release(owner)


def _drive_claimed(
    info: RunInfo,
    owner: str,
    view: Callable[[str], Any],
    interval_s: float,
    policy: dict[str, float] | None,
    live: LiveView | None,
    on_claim: Callable[[str], Any] | None,
) -> int:
    """:func:`drive_run` once ``owner`` holds the run's lease."""
    try:
        record_controller(info, owner)
        if on_claim is not None:
            on_claim(READY)
        ctl = build_controller(info, interval_s=interval_s, policy=policy, owner=owner)
        lighthouse = supervise_lighthouse(info, ctl.state)
    except RunError as e:
        view(f"spottrain: {e}")
        return EXIT_FAILED
    try:
        return _drive(info, ctl, view, lighthouse, live)
    finally:
        if live is not None:
            live.stop()  # the last frame stays on the screen, above what follows
        # The keeper only: like the Redis, the lighthouse outlives a controller that stops
        # while VMs still train; _drive stops it when nothing of the run runs any more.
        if lighthouse is not None:
            lighthouse.stop()


def lost_to_another(state: RunState, owner: str) -> bool:
    """Whether someone else holds the run's lease now: this controller must write nothing
    more into the run (its phase, its archive, its Redis are the holder's)."""
    try:
        holder = state.lease_holder()
    except redis.RedisError:
        return False
    return holder is not None and holder != owner


def _drive(
    info: RunInfo,
    ctl: Controller | GroupController,
    view: Callable[[str], Any],
    lighthouse: LighthouseSupervisor | None,
    live: LiveView | None = None,
) -> int:
    fleet = FleetTracker.start(info.run_id, ctl.spec, ctl.state)
    plain = PlainLines(view, lambda: ctl.state, ctl.spec.nodes.max)
    show = live.passes(info, ctl.state, ctl.spec.nodes.max, plain) if live else plain

    def on_pass(s: Summary) -> None:
        fleet.on_pass(s)
        show(s)

    code = EXIT_OK
    try:
        summary = drive_passes(
            ctl,
            on_pass,
            redis_outage_s=ctl.spec.controller.redis_outage_minutes * 60,
            on_report=view,
        )
    except ControllerError as e:
        view(f"spottrain: the controller stopped: {e}")
        if lost_to_another(ctl.state, ctl.owner):
            fleet.finish(None)
            return EXIT_FAILED
        try:
            ctl.state.set_ctl(phase=RunPhase.FAILED, error=str(e))
            summary = ctl.summary()
        except redis.RedisError:
            # Its Redis is gone: nothing to record or archive; the VMs train on.
            fleet.finish(None)
            return EXIT_FAILED
        code = EXIT_FAILED
    except BaseException:
        fleet.finish(None)  # interrupted: what was logged so far is kept
        raise
    fleet.finish(summary)
    if summary.final_step is None:
        code = EXIT_FAILED
    try:
        replica = replica_summary(ctl.state)
    except redis.RedisError:
        replica = None
    if live is not None:
        live.stop()
    for line in final_report(summary, replica):
        view(line)
    if ctl.done() or not ctl.live_vms():
        # Nothing of the run runs any more: keep its record on disk, free its Redis.
        archive_run(info, ctl.state.client, summary_record(summary, replica))
        if lighthouse is not None:
            lighthouse.stop()  # or it would start the lighthouse again
        end_lighthouse(info)
        if info.embedded_redis:
            stop_embedded_redis(info)
    return code
