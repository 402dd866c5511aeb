"""What a job spec leaves open to the internet, said as warnings for ``spottrain validate``.

Pure: reads a parsed :class:`~spottrain.spec.JobSpec` and asks no cloud. The defaults (no
public IP, encrypted AWS root volumes, a named GCP service account) give no warning; each
warning is about a key the spec set, or a network it leaves to the cloud's defaults. A
fleet made by Terraform is left out: its module, not the spec, decides how its VMs are
reached.
"""

from __future__ import annotations

from .job import JobSpec


def exposure_warnings(spec: JobSpec) -> list[str]:
    """One line per way the VMs this spec launches are exposed, each saying how to close it."""
    if spec.fleet is not None:
        return []
    warnings: list[str] = []
    clouds = set(spec.resources.clouds)
    if "aws" in clouds and spec.aws is not None:
        warnings += _aws_warnings(spec)
    if "gcp" in clouds and spec.gcp is not None:
        warnings += _gcp_warnings(spec)
    return warnings


def _aws_warnings(spec: JobSpec) -> list[str]:
    aws = spec.aws
    assert aws is not None
    out: list[str] = []
    if aws.public_ip:
        out.append(
            "aws.public_ip is true: every VM gets a public IP address and is reachable from "
            "the internet wherever its security groups allow; prefer private subnets with a "
            "NAT gateway (and public_ip: false)"
        )
    if not aws.security_groups:
        out.append(
            "aws.security_groups is empty: VMs get their VPC's default security group, "
            "whatever its rules are now; name groups that allow only what the job needs "
            "(inbound from the fleet itself, nothing from 0.0.0.0/0)"
        )
    if not aws.subnets:
        reach = (
            "and every VM's public IP sits in them"
            if aws.public_ip
            else "and, with no public IP and no NAT gateway there, VMs cannot reach Redis "
            "outside the VPC, the package registry or S3"
        )
        out.append(
            "aws.subnets is empty: VMs land in the default VPC's public subnets " + reach + "; "
            "give private subnets (per zone) with a NAT gateway or VPC endpoints"
        )
    else:
        out += _aws_zones_without_subnet(spec)
    if not aws.root_volume_encrypted:
        out.append(
            "aws.root_volume_encrypted is false: the root volume (code, caches, any "
            "secret written to disk) is encrypted only if the AMI or the account says so"
        )
    return out


def _aws_zones_without_subnet(spec: JobSpec) -> list[str]:
    aws = spec.aws
    assert aws is not None
    regions = spec.aws_regions()
    zones = [z for z in spec.resources.zones if any(z.startswith(r) for r in regions)]
    if zones:
        missing = [z for z in zones if z not in aws.subnets]
        if not missing:
            return []
        where = f"the zones {', '.join(missing)}"
    else:
        where = "any zone of " + ", ".join(regions) + " other than " + ", ".join(aws.subnets)
    return [
        f"aws.subnets has no subnet for {where}: VMs launched there land in the default "
        "VPC; give a subnet for each zone, or list only those zones in resources.zones"
    ]


def _gcp_warnings(spec: JobSpec) -> list[str]:
    gcp = spec.gcp
    assert gcp is not None
    out: list[str] = []
    if gcp.external_ip:
        out.append(
            "gcp.external_ip is true: every VM gets an external IP address and is reachable "
            "from the internet wherever the network's firewall allows (the default network "
            "allows SSH from anywhere); prefer Cloud NAT (and external_ip: false)"
        )
    if not gcp.network and not gcp.subnetwork:
        reach = (
            "whose default-allow-ssh rule opens port 22 to 0.0.0.0/0"
            if gcp.external_ip
            else "which has no Cloud NAT or Private Google Access unless you added them: "
            "without them VMs with no external IP cannot reach Redis outside the VPC, the "
            "package registry or Cloud Storage"
        )
        out.append(
            f"gcp.network and gcp.subnetwork are unset: VMs land in the 'default' network, "
            f"{reach}; name a subnetwork of your own"
        )
    if gcp.service_account == "default":
        broad = any(s.endswith("/cloud-platform") for s in gcp.scopes)
        scope = ", and the cloud-platform scope lets any code on a VM use all of it"
        out.append(
            "gcp.service_account is 'default': the Compute Engine default account usually "
            f"has Editor on the whole project{scope if broad else ''}; name a service account "
            "with only the roles the job needs"
        )
    return out
