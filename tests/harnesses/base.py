"""What the provider contract suite needs from each cloud's test double.

Each cloud's harness (``aws.py``, ``gcp.py``, ``local.py``) wraps a real provider pointed at a
fake of that cloud (moto, the HTTP fake of the compute API, local processes) and adds the
faults only a test can cause: a stockout, an interruption, revoked credentials.
``tests/integration/cloud/test_provider_contract.py`` runs one suite over all of them.
"""

from __future__ import annotations

from typing import Protocol

from spottrain.cloud.base import OfferQuery, Provider


class ProviderHarness(Protocol):
    """A provider under test plus the levers of its fake cloud."""

    provider: Provider

    def query(self) -> OfferQuery:
        """A query the fake can serve: one spot-capable 8-GPU type (or the local type) in
        at least two zones of one region, spot and on-demand allowed."""
        ...

    def inject_capacity_error(self, zone: str, instance_type: str) -> None:
        """From now on, launches of ``instance_type`` in ``zone`` fail as a stockout does."""
        ...

    def inject_auth_error(self) -> None:
        """From now on, every call fails as with revoked or missing credentials."""
        ...

    def clear_faults(self) -> None:
        """Undo every injected fault."""
        ...

    def interrupt(self, instance_id: str) -> None:
        """The cloud takes the VM back, as a spot interruption or preemption does."""
        ...

    def set_console(self, instance_id: str, text: str) -> None:
        """From now on the VM's console output (what ``console_output`` reads) ends with
        ``text``."""
        ...

    def close(self) -> None:
        """Stop the fake and remove what it left (VMs, processes, files)."""
        ...
