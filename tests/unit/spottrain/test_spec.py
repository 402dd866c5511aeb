"""The job spec: every field's validation, with the exact message a user sees."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from spec_samples import COMMIT, DIGEST, LOCAL, VALID, spec_with

from spottrain.spec import (
    AGREE_INTERVAL_S,
    MAX_AGREE_EVERY,
    NOTICE_DETECT_S,
    REQUEST_POLL_S,
    ArchiveCode,
    GitCode,
    ImageCode,
    Placement,
    SpecError,
    SpotPolicy,
    agreement_lag_s,
    check_notice_windows,
    load_spec,
    parse_count,
    parse_spec,
)


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(yaml.safe_dump(data, sort_keys=False), "job.yaml")
    return err.value.problems


def test_valid_spec_parses_with_defaults() -> None:
    spec = parse_spec(yaml.safe_dump(VALID), "job.yaml").spec
    assert isinstance(spec.code, ImageCode)
    assert spec.train.command == ("python", "train.py", "--lr", "3e-4")
    assert spec.nodes.workers_per_node == 8
    assert spec.resources.placement is Placement.SAME_ZONE
    assert spec.spot.policy is SpotPolicy.SPOT_THEN_ON_DEMAND
    assert spec.checkpoint.keep == 3
    assert spec.checkpoint.estimated_gb == pytest.approx(84.0)
    assert spec.redis.password_env == "SPOTTRAIN_REDIS_PASSWORD"
    assert spec.wandb is None


def test_local_spec_parses_and_splits_a_string_command() -> None:
    spec = parse_spec(yaml.safe_dump(LOCAL), "job.yaml").spec
    assert isinstance(spec.code, ArchiveCode)
    assert spec.train.command == ("examples/gpt_train.py", "--steps", "100")
    assert spec.redis.url == "embedded"
    assert spec.nodes.workers_per_node == 2
    assert spec.notice_windows == {"local": 30.0}


def test_scalar_nodes_means_a_fixed_size() -> None:
    spec = parse_spec(yaml.safe_dump(spec_with(LOCAL, "nodes", 3)), "job.yaml").spec
    assert (spec.nodes.min, spec.nodes.max) == (3, 3)


def test_git_code_needs_a_full_commit() -> None:
    ok = spec_with(VALID, "code", {"git": {"repo": "https://github.com/acme/t", "commit": COMMIT}})
    assert isinstance(parse_spec(yaml.safe_dump(ok)).spec.code, GitCode)


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            "name",
            "GPT_small",
            "name (line 1): use 1-48 lowercase letters, digits and dashes, starting and ending "
            "with a letter or digit (it becomes a cloud label) (got 'GPT_small')",
        ),
        ("name", ..., "name: required, missing"),
        (
            "code",
            {"image": "ghcr.io/acme/train:latest"},
            "code.image (line 3): pin the image by digest (registry/repo@sha256:<64 hex>), not "
            "by tag: a backfilled node must run exactly what the others run "
            "(got 'ghcr.io/acme/train:latest')",
        ),
        (
            "code",
            {"git": {"repo": "r", "commit": "main"}},
            "code.git.commit (line 5): give the full commit hash (40 hex characters), not a "
            "branch, tag or short hash: a backfilled node must check out exactly what the "
            "others run (got 'main')",
        ),
        (
            "code",
            {"git": {"repo": "r", "commit": COMMIT, "branch": "main"}},
            "code.git.branch (line 6): unknown key; allowed here: repo, commit, subdir, "
            "token_secret, token_user",
        ),
        (
            "code",
            {"image": f"x@{DIGEST}", "git": {"repo": "r", "commit": COMMIT}},
            "code (line 2): give exactly one of: image, git, archive (got 2)",
        ),
        (
            "code",
            {"docker": "x"},
            "code (line 2): unknown key 'docker'; give exactly one of: image, git, archive",
        ),
        (
            "code",
            {"archive": {"path": ".", "store": "ftp://x"}},
            "code.archive.store (line 5): use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or "
            "file:///DIR (got 'ftp://x')",
        ),
        (
            "train.command",
            [],
            "train.command (line 5): give the training script and its arguments (got [])",
        ),
        (
            "train.env",
            {"SPOTTRAIN_RUN_ID": "x"},
            "train.env (line 10): SPOTTRAIN_RUN_ID: SPOTTRAIN_* variables are set by spottrain "
            "itself",
        ),
        (
            "nodes",
            {"min": 4, "max": 2},
            "nodes (line 10): min (4) must not exceed max (2)",
        ),
        (
            "nodes.gpus",
            17,
            "nodes.gpus (line 13): must be less than or equal to 16 (got 17)",
        ),
        (
            "nodes.gpu",
            8,
            "nodes.gpu (line 14): unknown key; allowed here: min, max, gpus, workers",
        ),
        (
            "resources.clouds",
            ["aws", "azure"],
            "resources.clouds.1 (line 17): use 'aws', 'gcp' or 'local' (got 'azure')",
        ),
        (
            "resources.clouds",
            ["aws", "aws"],
            "resources.clouds (line 15): list each cloud once (got ['aws', 'aws'])",
        ),
        (
            "resources.placement",
            "anywhere",
            "resources.placement (line 25): use 'same-zone' or 'spread' (got 'anywhere')",
        ),
        (
            "resources.max_price_per_hour",
            0,
            "resources.max_price_per_hour (line 24): use a number above 0 up to 1,000 USD per "
            "VM-hour (got 0)",
        ),
        (
            "spot.policy",
            "cheapest",
            "spot.policy (line 26): use 'spot', 'spot-then-on-demand' or 'on-demand' "
            "(got 'cheapest')",
        ),
        (
            "budget.max_usd",
            -5,
            "budget.max_usd (line 29): use a number above 0 up to 100,000,000 USD (got -5)",
        ),
        ("budget", ..., "budget: required, missing"),
        (
            "checkpoint.volume.path",
            "ckpt",
            "checkpoint.volume.path (line 32): give an absolute path (the same on every node) "
            "(got 'ckpt')",
        ),
        (
            "checkpoint.volume.write_gbps",
            0,
            "checkpoint.volume.write_gbps (line 33): use a number above 0 up to 10,000 GB/s "
            "(got 0)",
        ),
        (
            "checkpoint.every_steps",
            ...,
            "checkpoint (line 30): say how often to checkpoint: every_steps, every_minutes, or "
            "both",
        ),
        (
            "checkpoint.params",
            "lots",
            "checkpoint.params (line 35): 'lots' is not a parameter count: use e.g. 7B, 350M or "
            "125000 (got 'lots')",
        ),
        (
            "checkpoint.copy_to",
            "bucket/x",
            "checkpoint.copy_to (line 36): use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or "
            "file:///DIR (got 'bucket/x')",
        ),
        (
            "redis.url",
            "redis://:hunter2@host:6379",
            "redis.url (line 38): the Redis endpoint embeds credentials (it contains '@'): put "
            "the password in $SPOTTRAIN_REDIS_PASSWORD or a password_file instead",
        ),
        (
            "redis.password",
            "hunter2",
            "redis (line 37): do not put the Redis password in the spec: name a variable with "
            "password_env or a file with password_file",
        ),
        (
            "redis.url",
            "embedded",
            "(top level): redis.url: 'embedded' only works for the local cloud; real VMs need a "
            "Redis they can reach (redis[s]://HOST:PORT)",
        ),
        (
            "aws",
            ...,
            "(top level): resources.clouds lists aws but the spec has no `aws:` section (see "
            "the README's job spec reference)",
        ),
        (
            "aws.images",
            {"us-east-1": "ubuntu-22"},
            "aws.images (line 41): us-east-1: 'ubuntu-22' is not an AMI id (ami-<hex>)",
        ),
        (
            "gcp.project",
            "Acme",
            "gcp.project (line 44): String should match pattern "
            "'^[a-z][a-z0-9-]{4,28}[a-z0-9]$' (got 'Acme')",
        ),
        (
            "wandb",
            {"project": "p", "mode": "sometimes"},
            "wandb.mode (line 49): use 'online', 'offline' or 'disabled' (got 'sometimes')",
        ),
        (
            "colour",
            "blue",
            "colour (line 47): unknown key; allowed here: name, code, train, nodes, resources, "
            "spot, budget, checkpoint, redis, wandb, local, aws, gcp, fleet, controller, logs, "
            "packages",
        ),
    ],
)
def test_bad_value_names_key_line_and_what_is_allowed(path: str, value: Any, expected: str) -> None:
    assert _problems(spec_with(VALID, path, value)) == [expected]


def test_redis_password_is_never_echoed() -> None:
    problems = _problems(spec_with(VALID, "redis.url", "redis://:hunter2@host:6379"))
    assert "hunter2" not in " ".join(problems)
    problems = _problems(spec_with(VALID, "redis.password", "hunter2"))
    assert "hunter2" not in " ".join(problems)


def test_every_problem_is_reported_at_once() -> None:
    data = spec_with(spec_with(VALID, "name", "Bad"), "budget.max_usd", 0)
    data = spec_with(data, "nodes.gpu", 1)
    assert len(_problems(data)) == 3


def test_unknown_instance_type_suggests_close_names() -> None:
    data = spec_with(VALID, "resources.instance_types", ["p4d.24xlarge", "p5.48xlarg"])
    (problem,) = _problems(data)
    assert problem.startswith("resources.instance_types: aws instance type 'p5.48xlarg' is not")
    assert "did you mean p5.48xlarge" in problem
    assert "SPOTTRAIN_CATALOG" in problem


def test_unknown_region_and_zone_outside_regions_are_errors() -> None:
    data = spec_with(VALID, "resources.regions", ["us-east-1", "mars-north1"])
    (problem,) = _problems(data)
    assert problem.startswith("resources.regions: 'mars-north1' is not a region of aws, gcp")
    data = spec_with(VALID, "resources.zones", ["us-west-2a"])
    (problem,) = _problems(data)
    assert problem == (
        "resources.zones: 'us-west-2a' is not in any of resources.regions (us-east-1, us-central1)"
    )


def test_local_zone_must_exist_in_the_local_cloud() -> None:
    data = spec_with(LOCAL, "resources.zones", ["local-z"])
    assert _problems(data) == [
        "resources.zones: 'local-z' is not a zone of local.zones (local-a, local-b)"
    ]


def test_local_cloud_cannot_mix_with_real_clouds() -> None:
    data = spec_with(VALID, "resources.clouds", ["aws", "local"])
    assert _problems(data) == [
        "(top level): resources.clouds: the local cloud cannot be mixed with real clouds"
    ]


def test_archive_code_on_a_real_cloud_needs_somewhere_to_upload() -> None:
    data = spec_with(VALID, "code", {"archive": {"path": "."}})
    data = spec_with(data, "checkpoint.copy_to", ...)
    assert _problems(data) == [
        "(top level): code.archive: say where to upload the archive (code.archive.store or "
        "checkpoint.copy_to)"
    ]


def test_malformed_yaml_and_non_mapping_are_clear() -> None:
    with pytest.raises(SpecError, match="not valid YAML"):
        parse_spec("name: [unclosed", "job.yaml")
    with pytest.raises(SpecError, match="must be a YAML mapping"):
        parse_spec("- a\n- b\n", "job.yaml")


def test_load_spec_reports_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        load_spec(tmp_path / "nope.yaml")
    assert err.value.problems == ["cannot read the file: No such file or directory"]


def test_load_spec_resolves_relative_paths_against_the_spec(tmp_path: Path) -> None:
    path = tmp_path / "jobs" / "job.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump(LOCAL))
    assert load_spec(path).base_dir == path.parent.resolve()


@pytest.mark.parametrize(
    ("text", "count"), [("7B", 7e9), ("350m", 350e6), ("1.3b", 1.3e9), ("125000", 125000)]
)
def test_parse_count_reads_suffixes(text: str, count: float) -> None:
    assert parse_count(text) == pytest.approx(count)


def test_window_check_fits_aws_but_not_gcp() -> None:
    # 7B params x 12 bytes = 84 GB at 2 GB/s = 42 s: inside AWS's 120 s, outside GCP's 30 s.
    data = spec_with(VALID, "checkpoint.volume.write_gbps", 2)
    spec = parse_spec(yaml.safe_dump(data)).spec
    checks = {c.cloud: c for c in check_notice_windows(spec)}
    assert checks["aws"].fits and not checks["gcp"].fits
    assert checks["aws"].write_s == pytest.approx(42.0)
    # 2 s to see the notice + 0.2 s to read the request + 0.4 s to agree (steps of at most
    # 0.2 s assumed) + 42 s + 10 s = 54.6 s.
    assert checks["aws"].needed_s == pytest.approx(54.6)
    assert "54.6 s of the 120 s notice window: fits, 65 s to spare" in checks["aws"].describe(
        84.0, 2
    )
    assert "does NOT fit: 25 s short" in checks["gcp"].describe(84.0, 2)


def test_window_check_counts_the_notice_detection_and_the_agreement_lag() -> None:
    # 37 GB at 2 GB/s = 18.5 s: 28.5 s with the commit alone would fit GCP's 30 s, but the
    # notice is seen up to 2 s late and the ranks take up to 0.6 s more to start the save.
    data = spec_with(VALID, "checkpoint.volume.write_gbps", 2)
    data = spec_with(data, "checkpoint.size_gb", 37)
    gcp = {c.cloud: c for c in check_notice_windows(parse_spec(yaml.safe_dump(data)).spec)}["gcp"]
    assert not gcp.fits and gcp.needed_s == pytest.approx(31.1)
    text = gcp.describe(37.0, 2)
    assert (
        "gcp: 37 GB at 2 GB/s takes 18.5 s; with 2.0 s to see the notice, 0.6 s to read the "
        "request and agree on the step (step time unknown: steps of at most 0.2 s assumed; "
        "set checkpoint.step_s) and 10 s to commit and leave, 31.1 s of the 30 s notice "
        "window: does NOT fit: 1 s short"
    ) in text
    # Slow steps agree every step: two 5 s steps before the save can start.
    slow = spec_with(spec_with(data, "checkpoint.size_gb", 1), "checkpoint.step_s", 5)
    gcp = {c.cloud: c for c in check_notice_windows(parse_spec(yaml.safe_dump(slow)).spec)}["gcp"]
    assert gcp.agree_s == pytest.approx(10.2) and gcp.needed_s == pytest.approx(22.7)
    assert gcp.fits and "step time unknown" not in gcp.describe(1.0, 2)


@pytest.mark.parametrize(
    ("step_s", "lag_s"),
    [(None, 0.4), (0.01, 0.4), (0.001, 0.128), (0.3, 0.6), (5.0, 10.0), (0.15, 0.3)],
)
def test_agreement_lag_is_two_of_the_sdks_agreement_spacings(
    step_s: float | None, lag_s: float
) -> None:
    assert agreement_lag_s(step_s) == pytest.approx(lag_s)


def test_window_model_matches_the_agents_defaults() -> None:
    import inspect

    from spottrain.agent import sdk
    from spottrain.agent.notices import poll_loop
    from spottrain.agent.sdk import agreement

    params = inspect.signature(sdk.TrainSession.__init__).parameters
    assert params["agree_interval"].default == AGREE_INTERVAL_S
    assert params["poll_interval"].default == REQUEST_POLL_S
    assert agreement._MAX_AGREE_EVERY == MAX_AGREE_EVERY
    assert poll_loop.DEFAULT_INTERVAL_S == NOTICE_DETECT_S


@pytest.mark.parametrize(
    ("clouds", "where", "url", "owner", "other"),
    [
        (["aws", "gcp"], "checkpoint.copy_to", "s3://acme/ckpt", "aws", "gcp"),
        (["aws", "gcp"], "checkpoint.copy_to", "gs://acme/ckpt", "gcp", "aws"),
        (["aws", "gcp"], "code.archive.store", "s3://acme/code", "aws", "gcp"),
        (["gcp"], "checkpoint.copy_to", "s3://acme/ckpt", "aws", "gcp"),
    ],
)
def test_a_store_some_allowed_cloud_cannot_read_is_refused(
    clouds: list[str], where: str, url: str, owner: str, other: str
) -> None:
    data = spec_with(VALID, "resources.clouds", clouds)
    if clouds == ["gcp"]:
        data = spec_with(data, "resources.regions", ["us-central1"])
        data = spec_with(data, "resources.instance_types", ["a2-highgpu-8g"])
        data = spec_with(data, "aws", ...)
    if where == "code.archive.store":
        data = spec_with(data, "code", {"archive": {"path": ".", "store": url}})
    else:
        data = spec_with(data, where, url)
    scheme = url.split("/", 1)[0]
    assert _problems(data) == [
        f"(top level): {where}: {scheme}// ({owner} storage) cannot be read by {other} VMs "
        "(each VM has only its own cloud's storage client and credentials), so a node there "
        "could restore no checkpoint nor fetch the code; one store per cloud is not "
        f"supported: use one cloud (resources.clouds: [{owner}]), or a file:// store on a "
        "file system every VM mounts"
    ]


def test_stores_every_allowed_cloud_reads_are_accepted() -> None:
    aws_only = spec_with(VALID, "resources.clouds", ["aws"])
    aws_only = spec_with(aws_only, "resources.regions", ["us-east-1"])
    aws_only = spec_with(aws_only, "resources.instance_types", ["p4d.24xlarge"])
    aws_only = spec_with(spec_with(aws_only, "gcp", ...), "checkpoint.copy_to", "s3://acme/ckpt")
    for data in (aws_only, VALID):  # VALID: aws + gcp, a file:// copy
        assert parse_spec(yaml.safe_dump(data)).spec.checkpoint.copy_to is not None


def test_window_check_is_empty_without_a_size() -> None:
    data = spec_with(VALID, "checkpoint.params", ...)
    assert check_notice_windows(parse_spec(yaml.safe_dump(data)).spec) == []


def test_spec_is_frozen() -> None:
    spec = parse_spec(yaml.safe_dump(VALID)).spec
    with pytest.raises(ValueError):
        spec.name = "other"  # type: ignore[misc]


# -- network, service account and encryption of the VMs the controller launches -----------

CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"


def test_cloud_sections_default_to_private_encrypted_vms() -> None:
    spec = parse_spec(yaml.safe_dump(VALID), "job.yaml").spec
    assert spec.aws is not None and spec.gcp is not None
    assert spec.aws.public_ip is False
    assert spec.aws.root_volume_encrypted is True and spec.aws.root_volume_kms_key is None
    assert spec.gcp.external_ip is False
    assert spec.gcp.service_account == "spottrain-agent@acme-train.iam.gserviceaccount.com"
    assert spec.gcp.scopes == (CLOUD_PLATFORM,)


def test_gcp_scopes_take_short_names_or_urls() -> None:
    data = spec_with(VALID, "gcp.scopes", ["devstorage.read_only", CLOUD_PLATFORM])
    spec = parse_spec(yaml.safe_dump(data), "job.yaml").spec
    assert spec.gcp is not None
    assert spec.gcp.scopes == (
        "https://www.googleapis.com/auth/devstorage.read_only",
        CLOUD_PLATFORM,
    )


def test_gcp_needs_a_named_service_account() -> None:
    (problem,) = _problems(spec_with(VALID, "gcp.service_account", ...))
    assert problem.startswith("gcp (line ")
    assert "service_account: name the service account the VMs run as" in problem
    assert "'default' picks the Compute Engine default account" in problem
    spec = parse_spec(yaml.safe_dump(spec_with(VALID, "gcp.service_account", "default"))).spec
    assert spec.gcp is not None and spec.gcp.service_account == "default"


@pytest.mark.parametrize(
    ("path", "value", "fragment"),
    [
        ("gcp.service_account", "nobody", "not a service account email"),
        ("gcp.scopes", ["https://example.com/scope"], "is not an OAuth scope"),
        ("gcp.scopes", [], "at least 1 item"),
        ("gcp.external_ip", "maybe", "must be a valid boolean"),
        ("aws.public_ip", "sometimes", "must be a valid boolean"),
        ("aws.root_volume_kms_key", "my key", "not a KMS key: give its id, alias/NAME"),
    ],
)
def test_bad_network_and_identity_keys_name_the_key(path: str, value: Any, fragment: str) -> None:
    (problem,) = _problems(spec_with(VALID, path, value))
    assert problem.startswith(path + " (line ") and fragment in problem


def test_a_kms_key_needs_encryption_on() -> None:
    data = spec_with(VALID, "aws.root_volume_kms_key", "alias/spottrain")
    data = spec_with(data, "aws.root_volume_encrypted", False)
    (problem,) = _problems(data)
    assert "root_volume_kms_key is set but root_volume_encrypted is false" in problem


def test_a_plain_script_window_counts_its_own_step_not_the_sdks_agreement() -> None:
    # A plain script gets SIGTERM at the notice and stops at the end of the step it is in:
    # with 5 s steps that is one step (5 s), where the SDK's agreement takes two (10.2 s).
    data = spec_with(VALID, "checkpoint.volume.write_gbps", 2)
    data = spec_with(spec_with(data, "checkpoint.size_gb", 1), "checkpoint.step_s", 5)
    sdk = {c.cloud: c for c in check_notice_windows(parse_spec(yaml.safe_dump(data)).spec)}
    plain_data = spec_with(data, "train.integration", "plain")
    plain = {c.cloud: c for c in check_notice_windows(parse_spec(yaml.safe_dump(plain_data)).spec)}
    assert sdk["gcp"].agree_s == pytest.approx(10.2)
    assert plain["gcp"].agree_s == pytest.approx(5.0)
    assert plain["gcp"].needed_s == pytest.approx(2 + 5 + 0.5 + 10)
    text = plain["gcp"].describe(1.0, 2)
    assert "5.0 s for the script to finish its step after SIGTERM" in text
    assert "read the request" not in text
