"""Pins the private torch 2.13 behaviour that the redis rendezvous handler relies on.

If torch changes any of it, one of these fails and names what moved, instead of the handler
misbehaving in a fleet. See agent/rendezvous/handler.py for why each is needed.
"""

from __future__ import annotations

import inspect
import os
import pickle
from datetime import UTC, datetime, timedelta
from importlib.metadata import entry_points
from typing import Any

import pytest
import torch
from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous import registry
from torch.distributed.launcher import api as launcher_api


def settings(min_nodes: int = 1, max_nodes: int = 3) -> dr.RendezvousSettings:
    return dr.RendezvousSettings(
        "run", min_nodes, max_nodes, dr.RendezvousTimeout(), timedelta(seconds=1), 5
    )


class MemoryBackend(dr.RendezvousBackend):
    """The smallest backend that honours the contract, to drive torch's code."""

    def __init__(self) -> None:
        self.blob: bytes | None = None
        self.token = 0

    @property
    def name(self) -> str:
        return "memory"

    def get_state(self) -> tuple[bytes, Any] | None:
        return None if self.blob is None else (self.blob, self.token)

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        if (self.blob is None and token is None) or token == self.token:
            self.blob, self.token = state, self.token + 1
            return state, self.token, True
        return None if self.blob is None else (self.blob, self.token, False)


def test_torch_is_the_release_these_pins_were_written_for() -> None:
    assert torch.__version__.startswith(("2.13", "2.14"))


def test_state_has_the_fields_the_handler_reads_and_edits() -> None:
    state = dr._RendezvousState()
    for field in (
        "round",
        "complete",
        "deadline",
        "closed",
        "participants",
        "wait_list",
        "redundancy_list",
        "last_heartbeats",
    ):
        assert hasattr(state, field), field
    assert pickle.loads(pickle.dumps(state)).round == 0


def test_node_desc_repr_is_addr_pid_localid_and_the_generator_makes_new_ids() -> None:
    gen = dr._NodeDescGenerator()
    a, b = gen.generate("10.0.0.1"), gen.generate("10.0.0.1")
    assert repr(a) == f"10.0.0.1_{os.getpid()}_{a.local_id}"
    assert a != b and repr(a) != repr(b)
    assert isinstance(dr.DynamicRendezvousHandler._node_desc_generator, dr._NodeDescGenerator)


def test_sync_calls_sanitize_after_clearing_dirty_so_sanitize_can_mark_dirty_again() -> None:
    seen: list[bool] = []

    class Probe(dr._BackendRendezvousStateHolder):
        def _sanitize(self) -> None:
            seen.append(self._dirty)
            self.mark_dirty()

    holder = Probe(MemoryBackend(), settings(), cache_duration=0)
    holder.mark_dirty()
    holder.sync()
    assert seen == [False]
    assert holder._dirty is True  # the next sync will write what sanitize changed


def test_removing_the_last_participant_of_a_complete_round_starts_the_next_round() -> None:
    state = dr._RendezvousState()
    state.complete = True
    state.round = 4
    dr._remove_participant_epilogue(state, settings())
    assert (state.round, state.complete) == (5, False)


def test_join_op_completes_a_round_once_its_deadline_has_passed() -> None:
    node = dr._NodeDescGenerator().generate("n")
    state = dr._RendezvousState()
    state.participants[node] = 0
    state.last_heartbeats[node] = datetime.now(UTC)
    state.deadline = datetime.now(UTC) - timedelta(seconds=1)
    ctx = dr._RendezvousContext(node, state, settings())
    action = dr._RendezvousJoinOp()(ctx, float("inf"))
    assert action == dr._Action.MARK_RENDEZVOUS_COMPLETE


def test_join_op_writes_no_keep_alive_while_our_heartbeat_entry_is_fresh() -> None:
    node = dr._NodeDescGenerator().generate("n")
    state = dr._RendezvousState()
    state.participants[node] = 0
    state.last_heartbeats[node] = datetime.now(UTC)
    state.deadline = datetime.now(UTC) + timedelta(seconds=60)
    ctx = dr._RendezvousContext(node, state, settings(min_nodes=1))
    assert dr._RendezvousJoinOp()(ctx, float("inf")) == dr._Action.SYNC
    state.last_heartbeats[node] -= timedelta(seconds=5)
    assert dr._RendezvousJoinOp()(ctx, float("inf")) == dr._Action.KEEP_ALIVE


def test_handler_attributes_and_hooks_the_subclass_overrides_exist() -> None:
    src = inspect.getsource(dr.DynamicRendezvousHandler.next_rendezvous)
    assert "self._stop_heartbeats()" in src and "self._start_heartbeats()" in src
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in src
    init = inspect.getsource(dr.DynamicRendezvousHandler.__init__)
    for attr in ("_this_node", "_op_executor", "_heartbeat_lock", "_state_holder", "_settings"):
        assert f"self.{attr} =" in init, attr
    assert src.index("self._get_world()") < src.index("RendezvousStoreInfo.build")
    assert "self._last_sync_time" in inspect.getsource(dr._BackendRendezvousStateHolder.sync)
    params = inspect.signature(dr._DistributedRendezvousOpExecutor).parameters
    assert list(params) == ["node", "state_holder", "settings"]
    assert inspect.signature(dr._RendezvousExitOp.__call__).parameters.keys() >= {"ctx"}


def test_agent_restarts_healthy_workers_only_when_num_nodes_waiting_is_positive() -> None:
    src = inspect.getsource(agent_api.SimpleElasticAgent._invoke_run)
    assert "rdzv_handler.num_nodes_waiting()" in src
    assert "if num_nodes_waiting > 0:" in src
    assert "self._restart_workers(self._worker_group)" in src


def test_agent_stops_workers_gracefully_on_a_signal_exception() -> None:
    src = inspect.getsource(agent_api.SimpleElasticAgent.run)
    assert "except SignalException as e:" in src
    assert "self._shutdown(e.sigval, timeout=self._shutdown_timeout)" in src


def test_launcher_does_not_close_the_rendezvous_when_the_agent_dies_of_a_signal() -> None:
    src = inspect.getsource(launcher_api.launch_agent)
    assert "except SignalException:" in src and "shutdown_rdzv = False" in src


def test_torchrun_loads_out_of_tree_handlers_from_the_entry_point_group() -> None:
    src = inspect.getsource(registry._register_out_of_tree_handlers)
    assert 'entry_points(group="torchrun.handlers")' in src
    assert "get_handler()" in src  # called with no arguments
    names = {ep.name: ep.value for ep in entry_points(group="torchrun.handlers")}
    assert names.get("redis") == "spottrain.agent.rendezvous.plugin:get_handler_creator"


def test_worker_processes_inherit_the_agent_environment() -> None:
    # The handler exports the rendezvous round to workers through os.environ.
    src = inspect.getsource(subprocess_handler.SubprocessHandler.__init__)
    assert "os.environ.copy()" in src


@pytest.mark.parametrize("name", ["RendezvousGracefulExitError", "RendezvousConnectionError"])
def test_rendezvous_error_types_exist(name: str) -> None:
    from torch.distributed.elastic.rendezvous import api

    assert issubclass(getattr(api, name), api.RendezvousError)
