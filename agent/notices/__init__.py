"""Preemption notices: what one is, one monitor per source, and the one handler.

Sources, one module each: the AWS spot instance-action (:mod:`.aws_spot`), the AWS rebalance
recommendation (:mod:`.aws_rebalance`), the Auto Scaling lifecycle (:mod:`.aws_asg`), GCP's
preempted flag (:mod:`.gcp_preempted`) and maintenance event (:mod:`.gcp_maintenance`),
SIGTERM (:mod:`.signals`) and notices injected through Redis (:mod:`.injected`). The
metadata monitors of one cloud share one session and are polled together (:mod:`.aws`,
:mod:`.gcp`, :mod:`.poll_loop`); :mod:`.sources` starts them for the agent. Monitors only
detect; :mod:`.handler` dedups by each event's own id and drains or checkpoints early.
"""

from .notice import Notice, NoticeKind

__all__ = ["Notice", "NoticeKind"]
