"""The local cloud under the provider contract suite: real VM processes in a temp dir."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from spottrain.cloud.base import Market, OfferQuery
from spottrain.cloud.local.compute import LocalProvider
from spottrain.cloud.local.settings import LocalSettings

# A VM's boot command for the contract suite: a long sleep that leaves on SIGTERM, like an
# agent with nothing to checkpoint.
IDLE_BOOT = '{"argv": ["sleep", "600"]}'


class LocalHarness:
    """A local cloud with two zones of four VMs each."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="spottrain-local-cloud-"))
        self.provider = LocalProvider(
            LocalSettings(self.dir, zones={"local-a": 4, "local-b": 4}, notice_s=2.0)
        )
        self.boot = IDLE_BOOT

    def query(self) -> OfferQuery:
        return OfferQuery(markets=(Market.SPOT, Market.ON_DEMAND))

    def inject_capacity_error(self, zone: str, instance_type: str) -> None:
        self.provider.set_capacity(zone, 0)

    def inject_auth_error(self) -> None:
        self.provider.set_refusal("auth")

    def clear_faults(self) -> None:
        self.provider.set_refusal(None)
        for zone, cap in self.provider.settings.zones.items():
            self.provider.set_capacity(zone, cap)

    def interrupt(self, instance_id: str) -> None:
        self.provider.preempt(instance_id, notice=False)

    def set_console(self, instance_id: str, text: str) -> None:
        """Appended to the VM's console file, as its boot command's output would be."""
        with open(self.provider.log_path(instance_id), "a") as f:
            f.write(text)

    def close(self) -> None:
        self.provider.set_refusal(None)
        for rec in self.provider.store.all():
            if rec["state"] != "terminated":
                self.provider.preempt(rec["id"], notice=False)
        shutil.rmtree(self.dir, ignore_errors=True)
