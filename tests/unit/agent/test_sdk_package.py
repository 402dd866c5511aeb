"""The SDK package: its public names, its light import for the token cache, and pickles.

SDK objects pickled before the SDK became a package still load (pickle resolves classes by
module path, and old pickles name ``spottrain.agent.sdk.<Class>``), and new pickles name the
same path, byte for byte. The fixtures were written by the single-module SDK (commit 2bb4cb7)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from spottrain.agent.sdk import GlobalBatch, ModelState, RngState

DATA = Path(__file__).parent / "data" / "sdk_pickles"


def _load(name: str) -> object:
    return pickle.loads((DATA / name).read_bytes())


@pytest.mark.parametrize("proto", [2, 5])
def test_global_batch_pickled_under_the_old_path_loads(proto: int) -> None:
    raw = (DATA / f"global_batch.p{proto}.pkl").read_bytes()
    assert b"spottrain.agent.sdk" in raw
    batch = pickle.loads(raw)
    assert type(batch) is GlobalBatch
    assert batch == GlobalBatch(global_size=256, micro_size=8, world=4, rank=1)
    # New pickles are the same bytes: old code reads what new code writes.
    assert pickle.dumps(batch, protocol=proto) == raw


@pytest.mark.parametrize("proto", [2, 5])
def test_rng_state_pickled_under_the_old_path_loads(proto: int) -> None:
    raw = (DATA / f"rng_state.p{proto}.pkl").read_bytes()
    rng = pickle.loads(raw)
    assert type(rng) is RngState
    assert pickle.dumps(rng, protocol=proto) == raw


def test_model_state_pickled_under_the_old_path_loads() -> None:
    state = _load("model_state.p5.pkl")
    assert type(state) is ModelState
    assert isinstance(state.model, torch.nn.Linear)
    assert state.optimizer is not None and state.scheduler is None
    assert set(state.state_dict()) == {"model", "optim"}


@pytest.mark.parametrize("cls", [GlobalBatch, ModelState, RngState])
def test_pickled_classes_name_the_public_path(cls: type) -> None:
    assert cls.__module__ == "spottrain.agent.sdk"
    assert cls.__qualname__ == cls.__name__


def test_the_token_cache_imports_without_torch() -> None:
    """Its tokenizing processes (spawned) import it afresh: the SDK package must not pull in
    torch for them, which would add seconds to every parallel build."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import spottrain.agent.sdk.token_cache.build\n"
        "import spottrain.agent.sdk\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from spottrain.agent.sdk import GlobalBatch\n"
        "assert 'torch' not in sys.modules, 'torch imported by GlobalBatch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_package_exports_the_documented_names() -> None:
    import spottrain.agent.sdk as sdk
    from spottrain.agent.sdk import session, state

    assert sdk.TrainSession is session.TrainSession
    assert sdk.ModelState is state.ModelState
    assert set(sdk.__all__) <= set(dir(sdk))
    for name in sdk.__all__:
        assert getattr(sdk, name) is not None
    with pytest.raises(AttributeError):
        sdk.NoSuchName  # noqa: B018
