"""The job spec: one YAML file that says everything about a job, validated at the edge.

Shared by the controller (which plans and launches from it) and the CLI (``spottrain
validate``); it imports no cloud SDK and no torch. Parsing is strict: an unknown key or a bad
value fails with the key's path, the line in the file, and what is allowed.

The reference for every field is the README's "Job spec" section; each model below carries
the same words in its field descriptions.

The package, by responsibility:

- the model, one module per group of sections: :mod:`~spottrain.spec.fields` (the base model,
  bounded numbers, names), :mod:`~spottrain.spec.code`, :mod:`~spottrain.spec.sections`,
  :mod:`~spottrain.spec.clouds` and :mod:`~spottrain.spec.job` (:class:`JobSpec`);
- loading and error text: :mod:`~spottrain.spec.loading` (size, depth and alias caps, the one
  YAML parse, :func:`parse_spec`, :func:`load_spec`) and :mod:`~spottrain.spec.errors`
  (:class:`SpecError` and the words of each bad key);
- checks: :mod:`~spottrain.spec.checks` (the catalog, the files a spec names, the stores each
  cloud can read, the notice window), :mod:`~spottrain.spec.replica` (what replica mode
  needs of the rest of the spec), :mod:`~spottrain.spec.frameworks` (the framework a job's
  integration needs on every node, and its versions) and :mod:`~spottrain.spec.exposure`
  (what a spec leaves open to the internet, as ``validate`` warnings).

Importers use the names below from ``spottrain.spec``.
"""

from .checks import (
    AGREE_INTERVAL_S,
    DRAIN_OVERHEAD_S,
    MAX_AGREE_EVERY,
    NOTICE_DETECT_S,
    NOTICE_WINDOW_S,
    REQUEST_POLL_S,
    WindowCheck,
    agreement_lag_s,
    check_notice_windows,
)
from .clouds import (
    AwsCloudSpec,
    FleetSpec,
    GcpCloudSpec,
    LocalCloudSpec,
    LocalPreemptions,
    LocalZone,
    PreemptionTraceRow,
)
from .code import ArchiveCode, ArchiveSource, CodeSpec, GitCode, GitSource, ImageCode
from .errors import SpecError
from .fields import (
    GCP_SCOPE_PREFIX,
    MAX_PARAMS,
    SECRET_STORE_HINT,
    EnvName,
    check_secret_name,
    parse_count,
    within,
)
from .frameworks import (
    FRAMEWORK_EXTRAS,
    FRAMEWORK_PACKAGES,
    describe_framework,
    extra_requirements,
    framework_extra,
    range_conflict,
    requirement_lines,
    venv_framework_problem,
)
from .job import JobSpec
from .loading import (
    MAX_SPEC_BYTES,
    MAX_SPEC_DEPTH,
    MAX_SPEC_VALUES,
    LoadedSpec,
    load_spec,
    parse_spec,
)
from .packages import PackagesSpec
from .replica import describe_replica, replica_agent_env
from .sections import (
    BudgetSpec,
    CheckpointSpec,
    ControllerSpec,
    FaultTolerance,
    Integration,
    LogsSpec,
    NodesSpec,
    Placement,
    QuorumKind,
    RedisSpec,
    ReplicaSpec,
    ResourcesSpec,
    SpotPolicy,
    SpotSpec,
    TrainSpec,
    VolumeSpec,
    WandbSpec,
)

__all__ = [
    "AGREE_INTERVAL_S",
    "DRAIN_OVERHEAD_S",
    "FRAMEWORK_EXTRAS",
    "FRAMEWORK_PACKAGES",
    "GCP_SCOPE_PREFIX",
    "MAX_AGREE_EVERY",
    "MAX_PARAMS",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_DEPTH",
    "MAX_SPEC_VALUES",
    "NOTICE_DETECT_S",
    "NOTICE_WINDOW_S",
    "REQUEST_POLL_S",
    "SECRET_STORE_HINT",
    "ArchiveCode",
    "ArchiveSource",
    "AwsCloudSpec",
    "BudgetSpec",
    "CheckpointSpec",
    "CodeSpec",
    "ControllerSpec",
    "EnvName",
    "FaultTolerance",
    "FleetSpec",
    "GcpCloudSpec",
    "GitCode",
    "GitSource",
    "ImageCode",
    "Integration",
    "JobSpec",
    "LoadedSpec",
    "LocalCloudSpec",
    "LocalPreemptions",
    "LocalZone",
    "LogsSpec",
    "NodesSpec",
    "PackagesSpec",
    "Placement",
    "PreemptionTraceRow",
    "QuorumKind",
    "RedisSpec",
    "ReplicaSpec",
    "ResourcesSpec",
    "SpecError",
    "SpotPolicy",
    "SpotSpec",
    "TrainSpec",
    "VolumeSpec",
    "WandbSpec",
    "WindowCheck",
    "agreement_lag_s",
    "check_notice_windows",
    "check_secret_name",
    "describe_framework",
    "describe_replica",
    "extra_requirements",
    "framework_extra",
    "load_spec",
    "parse_count",
    "parse_spec",
    "range_conflict",
    "replica_agent_env",
    "requirement_lines",
    "venv_framework_problem",
    "within",
]
