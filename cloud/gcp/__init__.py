"""The gcp cloud: spot (and on-demand) GPU VMs on Compute Engine through
``google-cloud-compute``, managed instance groups (:mod:`.group`) and Cloud Storage (:mod:`.gcs`).

How the :class:`~spottrain.cloud.base.Provider` contract maps onto Compute Engine:

- **Offers** come from the bundled catalog (GCP exposes no spot price API that this tool
  uses): every allowed region x zone x machine type x market. Not every zone of a region has
  every GPU type, so unless ``verify_zones`` is off, one ``machineTypes.aggregatedList`` per
  machine type (cached for an hour) keeps only the zones that really have it.
- **Launch** names the VM after the request id (:func:`instance_name`). Compute Engine refuses
  a second VM with the same name in a zone (409 ``alreadyExists``), so a repeated launch reads
  the existing VM back and returns it when its ``spottrain-request`` label matches. The insert
  is accepted asynchronously; a stockout is only known when its operation finishes, so launch
  waits for the operation (``zoneOperations.wait``) up to ``launch_wait_s`` and raises
  :class:`~spottrain.cloud.base.CapacityError` if it failed for capacity.
- **List** is one ``instances.aggregatedList`` filtered on the job label, plus, for zones with
  stopped VMs, one ``zoneOperations.list`` for ``compute.instances.preempted`` operations:
  Compute Engine marks a preempted VM only by that operation.
- **Terminate** deletes each VM and does not wait.

The client library is imported inside the functions that use it, so ``spottrain`` imports
without it; building a :class:`GcpProvider` without it raises ``ImportError`` naming the extra.

Two quirks of the library shape the calls here. The long-running ``insert``/``delete`` helpers
poll through a ``ZoneOperationsClient`` that the library builds with the default endpoint,
ignoring the client options (so a test endpoint would leak to the real API); this module
calls ``insert_unary``/``delete_unary`` and waits with its own operations client built with the
same options. And the read methods (get, list, aggregated list, operations get/list) retry 503
for up to ten minutes by default, which would freeze a reconcile pass; every call here passes
``retry=None`` and a timeout, and the reconcile loop is the retry.
"""

from spottrain.cloud.gcp.compute import GcpProvider
from spottrain.cloud.gcp.settings import GcpSettings

__all__ = ["GcpProvider", "GcpSettings"]
