"""The floor's environment variable names (spottrain.protocol.env): one name per variable,
every one under the prefix, and the SDK's documented names are the floor's."""

from __future__ import annotations

from spottrain.agent import sdk
from spottrain.protocol import env


def _names() -> dict[str, str]:
    return {k: v for k, v in vars(env).items() if k.startswith("ENV_") and k != "ENV_PREFIX"}


def test_every_name_is_a_spottrain_variable_once() -> None:
    names = _names()
    assert len(names) >= 30
    assert all(v.startswith(env.ENV_PREFIX) and v.isupper() for v in names.values())
    assert len(set(names.values())) == len(names), "two constants name one variable"


def test_the_values_are_the_variables_the_fleet_sets() -> None:
    # Written out: a boot script from one release sets what an agent from another reads.
    assert env.ENV_NODE == "SPOTTRAIN_NODE_ID"
    assert env.ENV_ROUND == "SPOTTRAIN_RDZV_ROUND"
    assert env.ENV_COPY_TO == "SPOTTRAIN_CKPT_COPY_TO"
    assert env.ENV_REDIS_PASSWORD_FILE == "SPOTTRAIN_REDIS_PASSWORD_FILE"
    assert env.ENV_FAILPOINT == "SPOTTRAIN_FAILPOINT"


def test_the_sdk_re_exports_its_documented_names() -> None:
    for name in ("ENV_CKPT_DIR", "ENV_COPY_TO", "ENV_NODE", "ENV_REDIS", "ENV_ROUND"):
        assert name in sdk.__all__
        assert getattr(sdk, name) == getattr(env, name)
