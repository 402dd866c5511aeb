"""Rank 0's wandb run for a session (one per rendezvous round) and the reference artifacts
of its committed checkpoints; see :mod:`spottrain.tracking`."""

from __future__ import annotations

import os
from pathlib import Path

from spottrain.protocol.env import ENV_COPY_TO
from spottrain.tracking import Tracker, WandbSettings, active_run, run_id_for, start_run

from ..checkpoint import dcp_io


def start_tracker(
    option: WandbSettings | bool, run_id: str | None, round_: int, world: int
) -> Tracker:
    """Rank 0's wandb run (see the package docstring): one per rendezvous round, so a
    re-formed group starts a new run of the job's group, and a rank 0 restarted in the
    same round resumes its run."""
    if option is False:
        return Tracker()
    settings = option if isinstance(option, WandbSettings) else WandbSettings.from_env()
    if settings is None:
        script_run = active_run()
        return Tracker(lambda: script_run, owned=False) if script_run is not None else Tracker()
    wandb_id = None
    if run_id:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        suffix = f"r{round_}" if round_ >= 0 else f"t{restart}"
        wandb_id = run_id_for(run_id, suffix)
    return start_run(
        settings,
        run_id=wandb_id,
        job_type="train",
        group=run_id,
        config={"spottrain_run": run_id, "round": round_, "world_size": world},
        step_metric="step",
    )


def track_commit(
    tracker: Tracker,
    result: dcp_io.SaveResult,
    kind: str,
    drain: bool,
    run_id: str | None,
    node: str,
) -> None:
    """Record a committed checkpoint as a reference artifact: the volume's directory and,
    when the agent copies checkpoints out, the copy it makes of this one."""
    if not tracker.active or result.path is None or result.manifest is None:
        return
    path = Path(result.path).absolute()
    run = run_id or "spottrain"
    refs = {"volume": path.as_uri(), "copy": copy_uri(run, path.name)}
    tracker.log_checkpoint(
        run_id_for(run, "ckpt"),
        refs,
        metadata={
            "step": result.step,
            "kind": kind,
            "drain": drain,
            "world_size": result.manifest.world_size,
            "round": result.manifest.round,
            "bytes": result.manifest.total_bytes,
            "node": node,
        },
        aliases=["latest", f"step-{result.step}", kind],
    )


def copy_uri(run: str, name: str) -> str:
    """Where the agent copies checkpoint ``name`` (``<copy_to>/<run>/<name>``, as
    :mod:`spottrain.agent.checkpoint.copy` lays it out), or "" when it copies none."""
    copy_to = os.environ.get(ENV_COPY_TO, "")
    if not copy_to:
        return ""
    from spottrain.cloud.storage import parse_store_url

    try:
        url = parse_store_url(copy_to)
    except ValueError:
        return ""
    if url.scheme == "file":
        return (Path(url.path) / run / name).as_uri()
    prefix = f"{url.path}/" if url.path else ""
    return f"{url.scheme}://{url.bucket}/{prefix}{run}/{name}"
