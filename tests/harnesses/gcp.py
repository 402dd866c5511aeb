"""The GCP provider under test: the real ``google-cloud-compute`` client against the HTTP fake
of the Compute Engine API (:mod:`fakes.gce`)."""

from __future__ import annotations

from fakes.gce import GceFake
from google.auth.credentials import AnonymousCredentials

from spottrain.cloud.base import Market, OfferQuery
from spottrain.cloud.gcp import GcpProvider, GcpSettings

REGION = "us-central1"
MACHINE_TYPE = "a2-highgpu-8g"


class GcpHarness:
    """A :class:`~harnesses.base.ProviderHarness` over a fresh fake, started on construction.

    Args:
        boot_delay: seconds between the fake VM's steps PROVISIONING -> STAGING -> RUNNING.
        **settings: overrides of :class:`GcpSettings` (``termination_action="DELETE"``, ...).
    """

    def __init__(self, *, boot_delay: float = 0.0, **settings: object) -> None:
        self.fake = GceFake(boot_delay=boot_delay).start()
        try:
            self.settings = GcpSettings(
                project=self.fake.project,
                regions=(REGION,),
                **settings,
            )
            self.provider = self.new_provider()
        except BaseException:
            self.fake.close()
            raise

    def new_provider(self) -> GcpProvider:
        """Another provider object over the same fake (a restarted controller's)."""
        return GcpProvider(
            self.settings, credentials=AnonymousCredentials(), api_endpoint=self.fake.url
        )

    def query(self) -> OfferQuery:
        return OfferQuery(
            regions=(REGION,),
            instance_types=(MACHINE_TYPE,),
            markets=(Market.SPOT, Market.ON_DEMAND),
        )

    def inject_capacity_error(self, zone: str, instance_type: str) -> None:
        self.fake.inject_stockout(zone, instance_type)

    def inject_auth_error(self) -> None:
        self.fake.inject_auth_error(401)

    def clear_faults(self) -> None:
        self.fake.clear_faults()

    def interrupt(self, instance_id: str) -> None:
        self.fake.preempt(instance_id)

    def set_console(self, instance_id: str, text: str) -> None:
        self.fake.set_console(instance_id, text)

    def close(self) -> None:
        """Stop the fake; an exception the fake raised while serving fails the test here."""
        self.fake.close()
        if self.fake.internal_errors:
            raise AssertionError(f"the GCE fake failed: {self.fake.internal_errors}")
