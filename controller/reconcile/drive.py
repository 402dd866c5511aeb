"""Pass after pass of a controller (of either kind of fleet), holding the run's lease,
stamping its heartbeat, and riding out a Redis outage."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis

from spottrain.cloud.base import AuthError, ProviderError
from spottrain.protocol.states import RunPhase

from .state import LeaseLost, RunState
from .summary import Summary

log = logging.getLogger("spottrain.controller")


class ControllerError(Exception):
    """The controller cannot go on (credentials refused, another controller holds the run)."""


class Driven(Protocol):
    """What :func:`drive_passes` runs: a controller of either kind of fleet."""

    run_id: str
    state: RunState
    owner: str
    interval_s: float

    def step(self) -> object: ...
    def summary(self) -> Summary: ...
    def done(self) -> bool: ...


# A controller that cannot reach Redis retries, waiting between tries from the first value
# up to the second (each with jitter, so a fleet of controllers does not retry in step).
REDIS_BACKOFF_S = (1.0, 30.0)
DEFAULT_REDIS_OUTAGE_S = 3600.0


@dataclass
class RedisOutage:
    """How long the controller's Redis has not answered, and the next wait before a try."""

    limit_s: float
    since: float | None = None
    tries: int = 0
    last_error: str = ""

    def failed(self, now: float, error: Exception) -> float:
        """Record a failed pass; returns the seconds to wait before the next try.

        Raises:
            ControllerError: Redis has not answered for ``limit_s``.
        """
        if self.since is None:
            self.since = now
        self.tries += 1
        self.last_error = str(error) or type(error).__name__
        down = now - self.since
        if down >= self.limit_s:
            raise ControllerError(
                f"Redis has not answered for {down:.0f} s ({self.last_error}); the controller "
                "stops, the VMs train on: bring Redis back, then `spottrain resume` drives the "
                "run again"
            )
        lo, hi = REDIS_BACKOFF_S
        wait = min(hi, lo * 2 ** (self.tries - 1))
        return min(random.uniform(wait / 2, wait), max(0.0, self.limit_s - down))

    def answered(self, now: float) -> float | None:
        """Redis answered: returns how long it was away (None: it was not)."""
        if self.since is None:
            return None
        down = now - self.since
        self.since, self.tries = None, 0
        return down


def drive_passes(
    ctl: Driven,
    on_pass: Callable[[Summary], object] | None = None,
    *,
    redis_outage_s: float = DEFAULT_REDIS_OUTAGE_S,
    on_report: Callable[[str], object] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    monotonic: Callable[[], float] = time.monotonic,
) -> Summary:
    """Pass after pass of ``ctl`` until the run is over, holding the run's lease and
    stamping the controller's heartbeat.

    Every side effect of a pass renews the lease first (:meth:`RunState.fence`), so a
    controller that lost it stops acting at once. A pass that Redis failed is tried again
    with a growing wait (``on_report`` says when Redis went and came back), up to
    ``redis_outage_s``.

    Raises:
        ControllerError: another controller holds the run, a cloud refused the
            credentials, or Redis did not answer for ``redis_outage_s``.
    """
    state, owner = ctl.state, ctl.owner
    ttl = max(10.0, ctl.interval_s * 5)
    outage = RedisOutage(redis_outage_s)
    report = on_report or (lambda line: None)
    first = True
    try:
        while True:
            try:
                _take_lease(ctl, ttl, first=first)
                first = False
                _redis_answers(state, outage.answered(monotonic()), report)
                summary = _one_pass(ctl, on_pass)
                if summary is not None:
                    return summary
            except LeaseLost as e:
                # The pass stopped at its next side effect; the next one takes the lease
                # again only if nobody else holds it.
                log.warning("%s: this pass stops here", e)
                report(f"spottrain: {e}; this pass stops here")
            except redis.RedisError as e:
                was_down = outage.since is not None
                wait = outage.failed(monotonic(), e)
                if not was_down:
                    report(
                        f"Redis does not answer ({e}): the controller retries for up to "
                        f"{redis_outage_s:.0f} s; the VMs train on"
                    )
                    log.warning("Redis does not answer (%s): retrying", e)
                sleep(wait)
                continue
            sleep(ctl.interval_s)
    finally:
        state.hold(None)
        with contextlib.suppress(redis.RedisError):
            state.release(owner)


def _take_lease(ctl: Driven, ttl: float, *, first: bool) -> None:
    """Take or renew the run's lease, hold it for the pass's side effects, and beat.

    Raises:
        ControllerError: another controller holds the lease.
    """
    state, owner = ctl.state, ctl.owner
    if not state.acquire(owner, ttl):
        holder = state.lease_holder()
        if first:
            raise ControllerError(
                f"run {ctl.run_id} is driven by another controller "
                f"({holder}); stop it first or wait {ttl:.0f} s"
            )
        raise ControllerError(
            f"lost the lease of run {ctl.run_id} to another controller ({holder})"
        )
    state.hold(owner, ttl)
    state.beat(owner, ttl)


def _redis_answers(state: RunState, down: float | None, report: Callable[[str], object]) -> None:
    if down is not None:
        report(f"Redis answers again after {down:.0f} s: the controller goes on")
        log.warning("Redis is back after %.0f s", down)
        state.event("redis-back", down_s=round(down, 1))


def _one_pass(ctl: Driven, on_pass: Callable[[Summary], object] | None) -> Summary | None:
    """One pass; returns the final summary when the run is over, else None."""
    state = ctl.state
    try:
        ctl.step()
    except AuthError as e:
        state.event("error", error=str(e))
        raise ControllerError(str(e)) from None
    except ProviderError as e:
        # A cloud could not be asked: skip this pass rather than act on half a view.
        state.event("observe-failed", error=str(e))
        log.warning("pass skipped: %s", e)
    summary = ctl.summary()
    if on_pass is not None:
        on_pass(summary)
    if ctl.done():
        phase = RunPhase.FAILED if state.ctl().get("error") else RunPhase.DONE
        state.set_ctl(phase=phase)
        return ctl.summary()
    return None
