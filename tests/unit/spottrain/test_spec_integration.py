"""``train.integration`` (issue 27): how the training script meets spottrain (the SDK, the
Hugging Face Trainer, Accelerate, Lightning, or a plain torchrun script), its default, the
one line a bad value gets, and replica mode's refusal of all but the SDK."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from spec_samples import LOCAL, VALID, spec_with

from spottrain.protocol import env as env_names
from spottrain.spec import JobSpec, SpecError, parse_spec


def _parse(data: dict[str, Any]) -> JobSpec:
    return parse_spec(yaml.safe_dump(data, sort_keys=False), "job.yaml").spec


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(yaml.safe_dump(data, sort_keys=False), "job.yaml")
    return err.value.problems


def test_a_spec_without_the_key_uses_the_sdk_and_each_value_parses() -> None:
    for base in (VALID, LOCAL):
        assert getattr(_parse(base).train, "integration", None) == "sdk"
    for value in ("sdk", "hf", "accelerate", "lightning", "plain"):
        assert _parse(spec_with(LOCAL, "train.integration", value)).train.integration == value
    assert _parse(spec_with(VALID, "train.integration", "sdk")) == _parse(VALID)


def test_a_bad_value_is_one_line_naming_the_values() -> None:
    assert _problems(spec_with(LOCAL, "train.integration", "keras")) == [
        "train.integration (line 7): use 'sdk', 'hf', 'accelerate', 'lightning' or 'plain' "
        "(got 'keras')"
    ]


@pytest.mark.parametrize(
    ("integration", "why"),
    [
        ("hf", "the Hugging Face Trainer owns its training loop and process group"),
        ("accelerate", "Accelerate owns its training loop and process group"),
        ("lightning", "Lightning owns its training loop and process group"),
        ("plain", "a plain script has no step boundary torchft can use"),
    ],
)
def test_replica_mode_refuses_every_integration_but_the_sdk(integration: str, why: str) -> None:
    data = spec_with(
        spec_with(LOCAL, "train.fault_tolerance", "replica"), "train.integration", integration
    )
    assert _problems(data) == [
        f"train (line 5): integration {integration} cannot run in replica mode: replica mode "
        "drives torchft's manager and its DDP/HSDP wrappers from spottrain's TrainSession, "
        f"and {why}: use fault_tolerance: elastic, or train with the SDK (integration: sdk)"
    ]
    sdk = spec_with(
        spec_with(LOCAL, "train.fault_tolerance", "replica"), "train.integration", "sdk"
    )
    assert _parse(sdk).train.integration == "sdk"


def test_the_agents_setting_is_named_only_when_it_is_not_the_sdk() -> None:
    assert _parse(LOCAL).train.integration_env() == {}
    plain = _parse(spec_with(LOCAL, "train.integration", "plain"))
    assert plain.train.integration_env() == {env_names.ENV_INTEGRATION: "plain"}
    assert env_names.ENV_INTEGRATION == "SPOTTRAIN_INTEGRATION"


def test_the_key_is_described_with_what_each_value_means() -> None:
    from spottrain.spec import TrainSpec

    doc = TrainSpec.model_fields["integration"].description or ""
    for value in ("sdk", "hf", "accelerate", "lightning", "plain"):
        assert f"{value} (" in doc
    assert "SIGTERM" in doc and "margin" in doc
