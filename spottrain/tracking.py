"""Experiment tracking with Weights & Biases, shared by the trainers and the controller.

wandb is optional (the ``spottrain[wandb]`` extra). Nothing here imports it unless tracking
is configured; when it is configured but not installed, one warning says which extra to
install and everything else goes on untracked.

**Who logs what.** Rank 0 of the trainers logs each step (loss and the script's other
metrics, ``step_time_s``, ``world_size``, ``tokens_per_s``) and records every committed
checkpoint as a reference artifact (see :meth:`Tracker.log_checkpoint`); the controller logs
the fleet (its fleet tracking, built on this module). Both runs share the wandb group named
after the spottrain run, so the wandb UI shows a job's training and its fleet side by side.

**Never in the way.** Every wandb call runs on a thread of the tracker's own, behind a
bounded queue, so a training step only pays for putting a dict on a queue, and a wandb that
is slow, offline or broken never stops training or the controller: a failure is logged once
and tracking goes on (or stays off, if the run could not start).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import queue
import re
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spottrain.spec import WandbSpec

log = logging.getLogger("spottrain.tracking")

EXTRA = "spottrain[wandb]"
ENV_PROJECT = "WANDB_PROJECT"
ENV_ENTITY = "WANDB_ENTITY"
ENV_MODE = "WANDB_MODE"
ENV_GROUP = "WANDB_RUN_GROUP"

# Characters wandb refuses in a run id.
_RESERVED = re.compile(r"[:;,#?/'\s]")
_missing_warned = False


@dataclass(frozen=True)
class WandbSettings:
    """Where a wandb run goes.

    Attributes:
        project: the wandb project.
        entity: the team or user (None: the API key's default entity).
        mode: ``online``, ``offline`` or ``disabled``; None leaves it to wandb (its own
            ``WANDB_MODE``, else online).
        group: the run group (default: the spottrain run id).
    """

    project: str
    entity: str | None = None
    mode: str | None = None
    group: str | None = None

    @property
    def disabled(self) -> bool:
        """``mode: disabled``, or no mode and ``WANDB_MODE=disabled``: track nothing and do
        not even import wandb."""
        mode = self.mode or os.environ.get(ENV_MODE, "")
        return mode.strip().lower() == "disabled"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WandbSettings | None:
        """The settings in ``WANDB_PROJECT`` (required), ``WANDB_ENTITY``, ``WANDB_MODE``
        and ``WANDB_RUN_GROUP``; None when no project is set (tracking is off)."""
        env = os.environ if environ is None else environ
        project = env.get(ENV_PROJECT, "").strip()
        if not project:
            return None
        return cls(
            project=project,
            entity=env.get(ENV_ENTITY) or None,
            mode=env.get(ENV_MODE) or None,
            group=env.get(ENV_GROUP) or None,
        )

    @classmethod
    def from_spec(cls, spec: WandbSpec | None) -> WandbSettings | None:
        """The job spec's ``wandb:`` section. Its ``mode`` counts only when the spec says it
        (the default leaves ``WANDB_MODE`` of the environment in charge)."""
        if spec is None:
            return None
        mode = spec.mode if "mode" in spec.model_fields_set else None
        return cls(project=spec.project, entity=spec.entity, mode=mode)


def trainer_env(spec: WandbSpec | None, run_id: str) -> dict[str, str]:
    """The variables that point the trainers' wandb at the job's project (for the agent's
    environment, which torchrun passes on to the workers): empty without a ``wandb:``
    section."""
    settings = WandbSettings.from_spec(spec)
    if settings is None:
        return {}
    env = {ENV_PROJECT: settings.project, ENV_GROUP: run_id}
    if settings.entity:
        env[ENV_ENTITY] = settings.entity
    if settings.mode:
        env[ENV_MODE] = settings.mode
    return env


def run_id_for(*parts: str) -> str:
    """A wandb run id from spottrain names (wandb refuses ``:;,#?/'`` and spaces)."""
    return _RESERVED.sub("-", "-".join(p for p in parts if p))


def wandb_available(settings: WandbSettings) -> bool:
    """Whether wandb can be imported, without importing it. When it cannot, warn once (per
    process) that tracking is configured but the extra is not installed."""
    global _missing_warned
    try:
        found = importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        found = False
    if not found and not _missing_warned:
        _missing_warned = True
        log.warning(
            "wandb tracking is configured (project %r) but wandb is not installed: "
            "pip install '%s' to track; going on without it",
            settings.project,
            EXTRA,
        )
    return found


def active_run() -> Any:
    """The wandb run this process already has (a script that called ``wandb.init``), or
    None; never imports wandb."""
    module = sys.modules.get("wandb")
    return getattr(module, "run", None) if module is not None else None


class _Stop:
    pass


_STOP = _Stop()


class Tracker:
    """One wandb run, or nothing (``Tracker()`` is the no-op tracker).

    Every method returns at once: the call is queued and run on the tracker's thread, which
    first starts the run. A call that fails is logged (once per tracker) and dropped.

    Args:
        start: returns the wandb run (called on the tracker's thread); None: no-op tracker.
        owned: whether :meth:`finish` finishes the run (False for a run the script made).
        max_pending: calls queued at most; beyond that (wandb stuck) new ones are dropped.
    """

    def __init__(
        self,
        start: Callable[[], Any] | None = None,
        *,
        owned: bool = True,
        max_pending: int = 10_000,
    ) -> None:
        self.run: Any = None
        self.owned = owned
        self._start = start
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._warned = False
        self._finished = False
        self._thread: threading.Thread | None = None
        if start is not None:
            self._thread = threading.Thread(target=self._work, name="spottrain-wandb", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        """Tracking was asked for and has not been finished (the run may still be starting,
        or have failed to start)."""
        return self._thread is not None and not self._finished

    # -- what callers log -----------------------------------------------------------------
    def log(self, data: Mapping[str, Any]) -> None:
        """One history row."""
        row = dict(data)
        self.call(lambda run: run.log(row))

    def update_summary(self, data: Mapping[str, Any]) -> None:
        values = dict(data)
        self.call(lambda run: run.summary.update(values))

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """A ``wandb.Table`` under ``key`` (a history row of its own)."""
        cols: list[str | int] = list(columns)
        data = [list(r) for r in rows]

        def log_it(run: Any) -> None:
            import wandb

            run.log({key: wandb.Table(columns=cols, data=data)})

        self.call(log_it)

    def log_checkpoint(
        self,
        name: str,
        refs: Mapping[str, str],
        *,
        metadata: Mapping[str, Any],
        aliases: Sequence[str] = (),
    ) -> None:
        """Record a checkpoint as a wandb artifact of type ``checkpoint`` that only refers
        to where the checkpoint is: each of ``refs`` (entry name -> URI) is added with
        ``add_reference(uri, checksum=False)``, so no byte of it is read or uploaded (a
        ``file://`` directory is listed, for its file names and sizes).

        A reference wandb cannot take (an object-storage URI whose SDK is not installed, a
        copy that does not exist yet) stays in the metadata as ``<name>_uri`` only; so does
        every other reference, so the metadata alone says where each copy is.
        """
        refs = {k: v for k, v in refs.items() if v}
        meta = {**metadata, **{f"{k}_uri": v for k, v in refs.items()}}
        tags = list(aliases)

        def log_it(run: Any) -> None:
            import wandb

            art = wandb.Artifact(name, type="checkpoint", metadata=meta)
            added = 0
            for entry, uri in refs.items():
                try:
                    art.add_reference(uri, name=entry, checksum=False)
                    added += 1
                except Exception as exc:
                    log.info("checkpoint reference %s kept in the metadata only: %s", uri, exc)
            if added:
                run.log_artifact(art, aliases=tags)

        self.call(log_it)

    def call(self, fn: Callable[[Any], object]) -> None:
        """Run ``fn(run)`` on the tracker's thread (nothing when tracking is off)."""
        if not self.active:
            return
        try:
            self._queue.put_nowait(fn)
        except queue.Full:
            self._warn_once("wandb is not keeping up: dropping tracking data")

    # -- the end --------------------------------------------------------------------------
    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every call queued so far has run; False after ``timeout``."""
        if not self.active:
            return True
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    def finish(self, *, exit_code: int = 0, timeout: float | None = 60.0) -> bool:
        """Run what is queued, finish the run (if this tracker started it), and stop the
        thread. Waits at most ``timeout`` seconds (an emergency exit cannot wait long);
        returns whether all of it was done in time."""
        if not self.active:
            return True
        assert self._thread is not None
        if self.owned:
            self.call(lambda run: run.finish(exit_code=exit_code))
        self._finished = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            return False
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("wandb did not finish within %.0f s: its last records may be lost", timeout)
            return False
        return True

    # -- the thread -----------------------------------------------------------------------
    def _work(self) -> None:
        assert self._start is not None
        try:
            self.run = self._start()
        except BaseException as exc:  # KeyboardInterrupt too: wandb's login prompt raises it
            self._warn_once(f"wandb could not start a run ({exc}): going on without tracking")
        while True:
            fn = self._queue.get()
            if fn is _STOP:
                return
            if isinstance(fn, threading.Event):  # flush()
                fn.set()
                continue
            if self.run is None:
                continue
            try:
                fn(self.run)
            except BaseException as exc:
                self._warn_once(f"wandb tracking failed ({exc}); training goes on")

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s", message)


def _check_credentials(wandb: Any, settings: WandbSettings) -> None:
    """An online run needs an API key; without one, wandb would ask for it on the terminal
    (from a background thread, in the middle of the controller's live view). Refuse instead.

    Raises:
        RuntimeError: online, and no credentials (``WANDB_API_KEY``, ``~/.netrc``).
    """
    modes = {(m or "online").strip().lower() for m in (settings.mode, os.environ.get(ENV_MODE))}
    if not modes <= {"online", "run"}:  # wandb.login() cannot tell, offline
        return
    try:
        logged_in = wandb.login(prompt=False, verify=False)
    except TypeError:  # a wandb without login(prompt=...): let init find out
        return
    if not logged_in:
        raise RuntimeError(
            "no wandb credentials: set WANDB_API_KEY or run `wandb login` (or use "
            "`wandb: {mode: offline}` and `wandb sync` later)"
        )


def start_run(
    settings: WandbSettings | None,
    *,
    run_id: str | None,
    job_type: str,
    group: str | None = None,
    config: Mapping[str, Any] | None = None,
    step_metric: str | None = None,
    quiet: bool = False,
) -> Tracker:
    """A tracker over a new wandb run, or the no-op tracker when tracking is off (no
    settings, ``mode: disabled``, or wandb not installed).

    The run resumes (``resume="allow"``) when ``run_id`` names one that exists, so a
    process that restarts under the same id continues its run. ``step_metric`` becomes the
    x-axis of every metric (``define_metric("*", step_metric=...)``).
    """
    if settings is None or settings.disabled or not wandb_available(settings):
        return Tracker()
    existing = active_run()
    if existing is not None:
        # The script made a run of its own: log into it, and leave its end to the script.
        return Tracker(lambda: existing, owned=False)
    cfg = dict(config or {})

    def start() -> Any:
        import wandb

        _check_credentials(wandb, settings)
        kwargs: dict[str, Any] = {
            "project": settings.project,
            "entity": settings.entity,
            "group": settings.group or group,
            "job_type": job_type,
            "config": cfg,
            "resume": "allow",
        }
        if run_id:
            kwargs["id"] = kwargs["name"] = run_id
        if settings.mode:
            kwargs["mode"] = settings.mode
        if quiet:
            kwargs["settings"] = wandb.Settings(quiet=True, console="off")
        run = wandb.init(**kwargs)
        if step_metric:
            run.define_metric(step_metric)
            run.define_metric("*", step_metric=step_metric)
        return run

    return Tracker(start)
