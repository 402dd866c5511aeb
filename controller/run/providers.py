"""From a job spec to the providers of the clouds it allows.

The one place that maps the spec's cloud sections onto each provider's settings, so the
controller, ``spottrain validate --check-clouds`` and the tests build providers the same way.
Cloud SDKs are imported only for the clouds a spec uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spottrain.catalog import Catalog, bundled
from spottrain.cloud.base import Provider
from spottrain.cloud.base.groups import Group
from spottrain.controller.reconcile.offers import regions_of
from spottrain.spec import JobSpec, LocalCloudSpec

if TYPE_CHECKING:
    from spottrain.cloud.local.compute import PreemptionInjector


@dataclass(frozen=True)
class Endpoints:
    """Where each cloud's API is, and with what credentials, when it is not the real one
    with the default credentials (tests, private endpoints)."""

    aws_endpoint_url: str | None = None
    aws_session: Any = None
    gcp_api_endpoint: str | None = None
    gcp_credentials: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def build_provider(
    spec: JobSpec,
    cloud: str,
    *,
    local_state_dir: Path | None = None,
    endpoints: Endpoints | None = None,
    catalog: Catalog | None = None,
) -> Provider:
    """The provider of ``cloud`` configured from ``spec``.

    Raises:
        ValueError: the spec lacks the cloud's section, or its settings are refused.
        ImportError: the cloud's SDK is not installed (the message names the extra).
    """
    ep = endpoints or Endpoints()
    cat = catalog or bundled()
    if cloud == "local":
        from spottrain.cloud.local.compute import LocalProvider
        from spottrain.cloud.local.settings import LocalSettings

        if local_state_dir is None:
            raise ValueError("the local cloud needs a state directory")
        local = spec.local or LocalCloudSpec()
        return LocalProvider(
            LocalSettings(
                local_state_dir,
                zones={name: z.capacity for name, z in local.zones.items()},
                launch_latency_s=local.launch_latency_s,
                notice_s=local.notice_s,
            ),
            catalog=cat,
        )
    if cloud == "aws":
        from spottrain.cloud.aws import AwsProvider, AwsSettings

        if spec.aws is None:
            raise ValueError("the spec has no `aws:` section")
        aws = spec.aws
        settings = AwsSettings(
            regions=tuple(spec.aws_regions()),
            image_ids=dict(aws.images),
            subnet_ids=dict(aws.subnets),
            security_group_ids=tuple(aws.security_groups),
            instance_profile=aws.instance_profile or "",
            key_name=aws.key_name or "",
            root_volume_gb=aws.root_volume_gb,
            public_ip=aws.public_ip,
            encrypt_root_volume=aws.root_volume_encrypted,
            root_volume_kms_key=aws.root_volume_kms_key or "",
            placement_group=aws.placement_group,
        )
        return AwsProvider(
            settings, session=ep.aws_session, catalog=cat, endpoint_url=ep.aws_endpoint_url
        )
    if cloud == "gcp":
        from spottrain.cloud.gcp import GcpProvider, GcpSettings

        if spec.gcp is None:
            raise ValueError("the spec has no `gcp:` section")
        gcp = spec.gcp
        gsettings = GcpSettings(
            project=gcp.project,
            regions=regions_of(spec, "gcp", cat),
            source_image=gcp.image,
            network=gcp.network or "",
            subnetwork=gcp.subnetwork or "",
            external_ip=gcp.external_ip,
            service_account=gcp.service_account or "",
            scopes=gcp.scopes,
            boot_disk_gb=gcp.boot_disk_gb,
        )
        return GcpProvider(
            gsettings,
            credentials=ep.gcp_credentials,
            api_endpoint=ep.gcp_api_endpoint or gcp.endpoints.compute,
            catalog=cat,
        )
    raise ValueError(f"unknown cloud {cloud!r}: use aws, gcp or local")


def build_group(spec: JobSpec, *, endpoints: Endpoints | None = None) -> Group:
    """The cloud group of a fleet that Terraform provisioned (the spec's ``fleet:``).

    Raises:
        ValueError: the spec has no ``fleet:`` section.
        ImportError: the cloud's SDK is not installed (the message names the extra).
    """
    fleet = spec.fleet
    if fleet is None:
        raise ValueError("the spec has no `fleet:` section")
    ep = endpoints or Endpoints()
    if fleet.cloud == "aws":
        from spottrain.cloud.aws.group import AwsAsgGroup

        assert fleet.region is not None  # the spec requires it for aws
        return AwsAsgGroup(
            fleet.region,
            fleet.group,
            fleet.run_id,
            lifecycle_hook=fleet.lifecycle_hook,
            session=ep.aws_session,
            endpoint_url=ep.aws_endpoint_url,
        )
    from spottrain.cloud.gcp.group import GcpMigGroup

    assert fleet.project is not None and fleet.zone is not None  # required for gcp
    compute = spec.gcp.endpoints.compute if spec.gcp is not None else None
    return GcpMigGroup(
        fleet.project,
        fleet.zone,
        fleet.group,
        api_endpoint=ep.gcp_api_endpoint or compute,
        credentials=ep.gcp_credentials,
    )


def build_providers(
    spec: JobSpec,
    *,
    local_state_dir: Path | None = None,
    endpoints: Endpoints | None = None,
    catalog: Catalog | None = None,
) -> dict[str, Provider]:
    """One provider per cloud the spec allows."""
    return {
        cloud: build_provider(
            spec, cloud, local_state_dir=local_state_dir, endpoints=endpoints, catalog=catalog
        )
        for cloud in spec.resources.clouds
    }


def preemption_injector(
    spec: JobSpec, provider: Provider, job: str, *, started_at: float, base_dir: Path
) -> PreemptionInjector | None:
    """The local cloud's injected preemptions for a run of ``spec`` (rate and/or trace, the
    trace read relative to the spec's directory); None when the spec injects none.

    Raises:
        ValueError: the trace file cannot be read, or the provider is not the local cloud.
    """
    from spottrain.cloud.local.compute import LocalProvider, PreemptionInjector
    from spottrain.trace import load_trace

    if spec.local is None:
        return None
    p = spec.local.preemptions
    if p.rate_per_hour == 0 and not p.trace:
        return None
    if not isinstance(provider, LocalProvider):
        raise ValueError("injected preemptions need the local cloud")
    trace = load_trace(base_dir / p.trace) if p.trace else []
    return PreemptionInjector(
        provider,
        job,
        started_at=started_at,
        rate_per_hour=p.rate_per_hour,
        notice_fraction=p.notice_fraction,
        trace=trace,
        seed=p.seed,
    )
