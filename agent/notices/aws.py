"""One poll of the EC2 instance metadata service: the three AWS notice monitors (spot
instance-action, rebalance recommendation, Auto Scaling lifecycle) over one IMDSv2 session.

The monitors share the session (one token for all three paths); each reads its own source
and gives its notices their own id.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .aws_asg import DEFAULT_ASG_GRACE_S, AsgLifecycleMonitor
from .aws_imds import AWS_MAX_TOKEN_TTL, ImdsSession
from .aws_rebalance import RebalanceMonitor
from .aws_spot import SpotActionMonitor
from .metadata_http import DEFAULT_TIMEOUT_S, WatcherError, all_failed, check_all
from .notice import Notice


class AwsImdsWatcher:
    """Watches IMDS (IMDSv2 only) for the end of this VM.

    One :meth:`poll` checks the spot interruption notice, the rebalance recommendation and
    the Auto Scaling target lifecycle state (see :mod:`.aws_imds` for the token, and
    :mod:`.aws_spot` for a spot notice that cannot be read).

    Args:
        endpoint: Base URL of IMDS. Default: ``$AWS_EC2_METADATA_SERVICE_ENDPOINT``, else
            ``http://169.254.169.254``. A trailing slash is fine.
        timeout: Seconds each socket operation of each request may take.
        token_ttl: Lifetime requested for session tokens, 1 to 21600 seconds.
        asg_grace: Seconds from first seeing the lifecycle state "Terminated" to the assumed
            deadline; Auto Scaling gives none, so this is deliberately short.
        clock: Wall clock for ``seen_at`` and derived deadlines.

    Raises:
        ValueError: On a bad timeout, token_ttl or asg_grace.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        token_ttl: int = AWS_MAX_TOKEN_TTL,
        asg_grace: float = DEFAULT_ASG_GRACE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.session = ImdsSession(endpoint, timeout=timeout, token_ttl=token_ttl)
        self.spot = SpotActionMonitor(self.session)
        self.rebalance = RebalanceMonitor(self.session)
        self.asg = AsgLifecycleMonitor(self.session, asg_grace)
        self.last_errors: list[str] = []
        self._clock = clock

    @property
    def endpoint(self) -> str:
        return self.session.endpoint

    @property
    def token_ttl(self) -> int:
        return self.session.token_ttl

    @property
    def asg_grace(self) -> float:
        return self.asg.grace

    @property
    def timeout(self) -> float:
        return self.session.http.timeout

    def poll(self) -> list[Notice]:
        """Checks all three paths once.

        Returns:
            The notices showing now (empty when there are none). Paths that failed, and
            spot notices that could not be read, are in :attr:`last_errors`, one line each.

        Raises:
            WatcherError: When no path could be checked (no token, or every path failed).
        """
        self.last_errors = []
        try:
            self.session.current_token()
        except WatcherError as exc:
            self.last_errors = [str(exc)]
            raise
        now = self._clock()
        checks: tuple[Callable[[], Notice | None], ...] = (
            lambda: self.spot.check(now),
            lambda: self.rebalance.check(now),
            lambda: self.asg.check(now),
        )
        notices, errors = check_all(checks)
        warnings = [self.spot.warning] if self.spot.warning else []
        self.last_errors = [str(e) for e in errors] + warnings
        if len(errors) == len(checks):
            raise all_failed(errors)
        return notices
