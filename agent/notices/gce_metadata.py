"""The GCE metadata server, shared by the GCP notice monitors.

Every answer must carry ``Metadata-Flavor: Google``; one without it came from something else
(a captive proxy, a misrouted host) and is treated as garbage.
"""

from __future__ import annotations

import os
from urllib.parse import urlencode

from .metadata_http import DEFAULT_TIMEOUT_S, HttpResponse, MetadataHttp, request_error

GCP_HOST_ENV = "GCE_METADATA_HOST"
DEFAULT_GCP_HOST = "metadata.google.internal"
GCP_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
GCP_MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
GCP_FLAVOR_HEADER = "Metadata-Flavor"
GCP_FLAVOR = "Google"


class GceMetadata:
    """Requests to the GCE metadata server.

    Args:
        host: ``host[:port]`` of the metadata server. Default: ``$GCE_METADATA_HOST``, else
            ``metadata.google.internal``. An ``http://`` prefix is tolerated.
        timeout: Seconds each socket operation of a request may take; a long-poll gets its
            ``timeout_sec`` on top.

    Raises:
        ValueError: On a bad timeout.
    """

    def __init__(self, host: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        raw = host or os.environ.get(GCP_HOST_ENV) or DEFAULT_GCP_HOST
        self.host = raw.removeprefix("http://").rstrip("/")
        self.http = MetadataHttp(timeout)

    @property
    def timeout(self) -> float:
        return self.http.timeout

    def url(self, path: str) -> str:
        return f"http://{self.host}{path}"

    def get(self, path: str, query: dict[str, str] | None = None, extra: float = 0) -> HttpResponse:
        """GETs one path; the answer is a 200 from the metadata server.

        Args:
            extra: Seconds added to the timeout (a long-poll's ``timeout_sec``).

        Raises:
            WatcherError: On any other answer, or when the request fails.
        """
        url = self.url(path) + (f"?{urlencode(query)}" if query else "")
        resp = self.http.request(
            "GET", url, {GCP_FLAVOR_HEADER: GCP_FLAVOR}, timeout=self.timeout + extra
        )
        if resp.header(GCP_FLAVOR_HEADER) != GCP_FLAVOR:
            raise request_error(
                "GET",
                url,
                f"answered without the {GCP_FLAVOR_HEADER}: {GCP_FLAVOR} header "
                "(not the metadata server?)",
            )
        if resp.status != 200:
            raise request_error("GET", url, f"returned unexpected HTTP {resp.status}")
        return resp
