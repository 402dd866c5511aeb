"""``spottrain validate``: a spec's keys, catalog, notice windows, replica mode and the
framework its integration needs (on the VMs, and in this venv for the local cloud); with
``--check-clouds``, each allowed cloud's offers (or a Terraform fleet's group)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from spottrain.controller.cli.common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_WINDOW
from spottrain.spec import JobSpec


def validate(args: argparse.Namespace) -> int:
    from spottrain.controller.run.env_lock import local_framework_problem, spottrain_requires
    from spottrain.spec import SpecError, check_notice_windows, load_spec
    from spottrain.spec.exposure import exposure_warnings

    try:
        loaded = load_spec(args.spec)
    except SpecError as e:
        if args.json:
            print(json.dumps({"valid": False, "source": e.source, "problems": e.problems}))
        else:
            print(str(e), file=sys.stderr)
        return EXIT_BAD_INPUT
    spec = loaded.spec
    requires = spottrain_requires()
    problem = spec.files_store_problem() or local_framework_problem(spec, requires)
    if problem:
        # Valid YAML and keys, but `up` could not launch it (no store the VMs read, or the
        # local VMs' venv, this one, lacks the framework): say so here, before a run.
        if args.json:
            print(json.dumps({"valid": False, "source": loaded.source, "problems": [problem]}))
        else:
            print(f"{loaded.source}: the job spec is not valid:\n  {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    checks = check_notice_windows(spec)
    size = spec.checkpoint.estimated_gb
    gbps = spec.checkpoint.volume.write_gbps
    fits = all(c.fits for c in checks)
    warnings = exposure_warnings(spec)
    if args.json:
        print(
            json.dumps(
                {
                    "valid": True,
                    "name": spec.name,
                    "fault_tolerance": spec.train.fault_tolerance.value,
                    "integration": spec.train.integration.value,
                    "replica": _replica_json(spec),
                    "framework": _framework_json(spec, requires),
                    "checkpoint_gb": size,
                    "windows": [
                        {
                            "cloud": c.cloud,
                            "window_s": c.window_s,
                            "write_s": round(c.write_s, 3),
                            "fits": c.fits,
                        }
                        for c in checks
                    ],
                    "warnings": warnings,
                }
            )
        )
    else:
        print(f"{loaded.source}: valid job spec for {spec.name!r}")
        for line in _job_lines(spec, requires):
            print(f"  {line}")
        if size is None:
            print(
                "  emergency checkpoint: size unknown (set checkpoint.size_gb or "
                "checkpoint.params to check it against the notice windows)"
            )
        for c in checks:
            assert size is not None
            print("  " + c.describe(size, gbps))
        for warning in warnings:
            print(f"  warning: {warning}", file=sys.stderr)
    if args.check_clouds and not _check_clouds(spec, quiet=args.json):
        return EXIT_FAILED
    return EXIT_OK if fits else EXIT_WINDOW


def _job_lines(spec: JobSpec, requires: list[str]) -> list[str]:
    """validate's lines of the job: its fleet's size and terms, its integration and the
    framework the nodes install for it (``requires``: spottrain's ``Requires-Dist``), replica
    mode, a Terraform fleet."""
    from spottrain.spec import describe_framework, describe_replica

    lines = [
        f"nodes {spec.nodes.min}-{spec.nodes.max} x {spec.nodes.gpus} GPUs, "
        f"clouds {', '.join(spec.resources.clouds)}, spot policy {spec.spot.policy.value}, "
        f"budget ${spec.budget.max_usd:,.2f}"
    ]
    more = (_describe_integration(spec), describe_framework(spec, requires), describe_replica(spec))
    lines += filter(None, more)
    if spec.fleet is not None:
        f = spec.fleet
        where = f.region if f.cloud == "aws" else f"{f.project}/{f.zone}"
        lines.append(
            f"fleet: the {f.cloud} group {f.group} in {where}, made by Terraform, "
            f"adopted as run {f.run_id}"
        )
    return lines


# validate's line for an integration other than the SDK's: what a notice does for it.
_INTEGRATION_LINES = {
    "hf": "the Trainer's spottrain callback saves on the agent's checkpoint request",
    "accelerate": "spottrain's Accelerate helper saves on the agent's checkpoint request",
    "lightning": "the Lightning spottrain callback saves on the agent's checkpoint request",
    "plain": "on a notice the workers get SIGTERM at once and have until the deadline less "
    "the agent's notice margin (5 s) to save on their own; then SIGKILL",
}


def _describe_integration(spec: JobSpec) -> str | None:
    """validate's line for a job not on the SDK (None for one on it)."""
    value = spec.train.integration.value
    return f"integration {value}: {_INTEGRATION_LINES[value]}" if value != "sdk" else None


def _framework_json(spec: JobSpec, requires: list[str]) -> dict[str, Any] | None:
    """``--json``'s ``framework``: the extra the job's integration installs on every node
    and its requirements (null for sdk and plain)."""
    from spottrain.spec import extra_requirements, framework_extra

    extra = framework_extra(spec)
    if extra is None:
        return None
    reqs = [f"{r.name}{r.specifier}" for r in extra_requirements(requires, extra)]
    return {"extra": extra, "requires": reqs}


def _replica_json(spec: JobSpec) -> dict[str, int | float | str] | None:
    """``--json``'s ``replica``: the replica's size, the range of replicas, the quorum's
    floor and where it forms, and in Redis the join and heartbeat timeouts as resolved
    (``auto`` depends on the fleet); null for an elastic job."""
    from spottrain.spec.replica import heartbeat_timeout_s, join_timeout_ms

    if spec.train.fault_tolerance.value != "replica":
        return None
    k = spec.train.replica.nodes_per_replica
    out: dict[str, int | float | str] = {
        "nodes_per_replica": k,
        "min_replicas": spec.train.replica.min_replicas,
        "replicas_min": spec.nodes.min // k,
        "replicas_max": spec.nodes.max // k,
        "quorum": spec.train.replica.quorum.value,
    }
    if spec.train.replica.quorum.value == "redis":
        out["join_timeout_ms"] = join_timeout_ms(spec)
        out["heartbeat_timeout_s"] = heartbeat_timeout_s(spec)
    return out


def _check_clouds(spec: JobSpec, *, quiet: bool) -> bool:
    """Ask each allowed cloud for the spec's offers; print what each says."""
    import tempfile

    from spottrain.cloud.base import ProviderError
    from spottrain.controller.reconcile.offers import offer_query
    from spottrain.controller.run.providers import build_provider

    if spec.fleet is not None:
        return _check_group(spec, quiet=quiet)
    ok = True
    with tempfile.TemporaryDirectory(prefix="spottrain-validate-") as tmp:
        for cloud in spec.resources.clouds:
            try:
                provider = build_provider(spec, cloud, local_state_dir=Path(tmp))
                offers = provider.offers(offer_query(spec, cloud))
            except (ProviderError, ImportError, ValueError) as e:
                ok = False
                print(f"  {cloud}: cannot use it: {e}", file=sys.stderr)
                continue
            if not offers:
                ok = False
                print(
                    f"  {cloud}: no offer matches the spec (instance types, regions, zones, "
                    "max price, spot policy)",
                    file=sys.stderr,
                )
            elif not quiet:
                o = offers[0]
                print(
                    f"  {cloud}: {len(offers)} offers; cheapest {o.instance_type} {o.market} in "
                    f"{o.zone} at ${o.price_per_hour:,.2f}/h"
                )
    return ok


def _check_group(spec: JobSpec, *, quiet: bool) -> bool:
    """Ask the cloud for the Terraform fleet's group; print what it holds."""
    from spottrain.cloud.base import ProviderError
    from spottrain.controller.run.providers import build_group

    assert spec.fleet is not None
    cloud = spec.fleet.cloud
    try:
        view = build_group(spec).describe()
    except (ProviderError, ImportError, ValueError) as e:
        print(f"  {cloud}: cannot use the fleet's group: {e}", file=sys.stderr)
        return False
    if not quiet:
        cap = f" of at most {view.max_size}" if view.max_size is not None else ""
        print(
            f"  {cloud}: group {view.name}: size {view.target}{cap}, "
            f"{len(view.alive)} VMs running or starting"
        )
    return True
