"""The agent's ``--integration`` (``SPOTTRAIN_INTEGRATION``, issue 27) and what it decides,
without I/O: which integration signals its workers at once, how long torchrun lets a
signalled worker save, and the one line a bad setting gets."""

from __future__ import annotations

import pytest

from spottrain.agent.config import AgentConfig, AgentConfigError


def _cfg(**kw: object) -> AgentConfig:
    return AgentConfig(
        redis_url="redis://127.0.0.1:1", run_id="r", node_id="n", train_cmd=["t.py"], **kw
    )  # type: ignore[arg-type]


def test_only_a_plain_script_is_signalled_at_once() -> None:
    assert _cfg().integration == "sdk"
    assert _cfg(integration="plain").signals_first
    for other in ("sdk", "hf", "accelerate", "lightning"):
        assert not _cfg(integration=other).signals_first
        _cfg(integration=other).validate()


def test_torchrun_lets_a_signalled_worker_save_for_the_agents_longest_window() -> None:
    # torch's own default is 30 s: shorter than any cloud's window but GCP's.
    assert _cfg().torchrun_shutdown_timeout == 150
    assert _cfg(sigterm_grace=600).torchrun_shutdown_timeout == 600
    assert _cfg(worker_stop_timeout=90.5, sigterm_grace=10).torchrun_shutdown_timeout == 91


def test_a_bad_integration_is_one_line_naming_the_values() -> None:
    with pytest.raises(AgentConfigError) as err:
        _cfg(integration="keras").validate()
    assert str(err.value) == (
        "integration 'keras' (--integration, SPOTTRAIN_INTEGRATION) must be one of sdk, hf, "
        "accelerate, lightning, plain"
    )
    with pytest.raises(AgentConfigError) as err:
        _cfg(integration="plain", fault_tolerance="replica").validate()
    assert str(err.value) == (
        "integration plain cannot run in replica mode, which drives torchft from spottrain's "
        "TrainSession: use --fault-tolerance elastic or --integration sdk"
    )
    with pytest.raises(AgentConfigError, match=r"notice margin -1 s \(--notice-margin\)"):
        _cfg(notice_margin=-1.0).validate()
