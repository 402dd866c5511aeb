"""``spottrain report RUN``: a run's timeline (world size, step rate, preemptions, cost) as a
PNG and a text summary, for a running run (from its Redis) or a finished one (from the files
``archive_run`` left in its directory).

Where each panel's data comes from (the progress hash is overwritten at every step, so
timelines are rebuilt from the event stream and the launch ledger):

- **world size**: nodes training, from the agents' ``state`` events (a node counts from
  ``joined`` until ``draining``, ``left`` or ``failed``) and the controller's end of its VM
  (``preempted``, ``vm-ended``, ``terminate``: a VM killed without notice says nothing
  itself); and ranks, the world size of each rendezvous round, from the SDK's ``restored``
  events (rank 0 writes one each time the workers restart, so once per round).
- **step rate**: steps per minute between consecutive known (time, step) points: each
  ``checkpoint-committed`` event, each ``restored`` event (the step the job had reached,
  then the step it went back to), ``progress`` events if the SDK writes them, and the live
  progress hash when it is ahead of them. Its resolution is the checkpoint cadence.
- **preemptions**: the controller's ``preempted`` events (time, node, zone), with the
  agent's first draining ``notice`` for that node if it had one; ledger records marked
  interrupted whose event was trimmed from the stream are added at their end time.
- **cost**: cumulative dollars from the launch ledger (each VM's price x hours between its
  launch and its end, and the same hours at the on-demand price); an archive without
  ``launches.json`` falls back to the ``launched`` events (which carry the price) and the
  end events, and then has no on-demand figure.

All times in :class:`ReportData` are unix seconds; ``start`` is the run's creation.
"""

from spottrain.controller.report.build import build_report
from spottrain.controller.report.inputs import (
    read_archive_inputs,
    read_redis_inputs,
    write_report_inputs,
)
from spottrain.controller.report.model import (
    CostPoint,
    Figures,
    NodesPoint,
    NoReportData,
    Preemption,
    RateSegment,
    ReplicaReportData,
    ReportData,
    ReportInputs,
    StepPoint,
    VmSpan,
    WorldPoint,
)
from spottrain.controller.report.png import render_png
from spottrain.controller.report.text import text_summary
from spottrain.protocol.states import ENDED_PHASES

__all__ = [
    "ENDED_PHASES",
    "CostPoint",
    "Figures",
    "NoReportData",
    "NodesPoint",
    "Preemption",
    "RateSegment",
    "ReplicaReportData",
    "ReportData",
    "ReportInputs",
    "StepPoint",
    "VmSpan",
    "WorldPoint",
    "build_report",
    "read_archive_inputs",
    "read_redis_inputs",
    "render_png",
    "text_summary",
    "write_report_inputs",
]
