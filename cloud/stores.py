"""Opening a store from its URL (``s3://``, ``gs://``, ``file://`` or a path).

The S3 and GCS stores live with their clouds (:mod:`spottrain.cloud.aws.s3`,
:mod:`spottrain.cloud.gcp.gcs`) and are imported only when a URL names them, so this module
imports without either SDK. It sits beside ``storage``, ``aws`` and ``gcp`` rather than inside
``storage``: the clouds build their stores on ``storage``, which must not import them back."""

from __future__ import annotations

import os

from spottrain.cloud.storage.factory import parse_store_url
from spottrain.cloud.storage.interface import ObjectStore
from spottrain.cloud.storage.local import LocalStore

# Where Cloud Storage's JSON API is when not at its public name (a Private Service Connect
# endpoint, the box's fake): google-cloud-storage's own variable.
GCS_ENDPOINT_ENV = "API_ENDPOINT_OVERRIDE"


def open_store(url: str) -> ObjectStore:
    """Open the store a URL names, with the SDK's default credentials.

    ``s3://`` uses boto3's default session (``AWS_PROFILE``, ``AWS_ENDPOINT_URL_S3`` and the
    rest of its environment apply; an endpoint from the environment is addressed
    path-style); ``gs://`` uses Application Default Credentials (and
    ``STORAGE_EMULATOR_HOST`` or ``API_ENDPOINT_OVERRIDE`` when set); a ``file://`` URL or a
    path opens a :class:`LocalStore` on a directory that must exist.

    Raises:
        ValueError: a malformed URL; the message lists the accepted forms.
        MissingSdkError: the SDK for that scheme is not installed.
        StorageAuthError: no credentials could be found (GCS checks at construction).
    """
    parsed = parse_store_url(url)
    if parsed.scheme == "s3":
        from spottrain.cloud.aws.s3 import S3Store  # imports boto3 only when used

        return S3Store(parsed.bucket, parsed.path)
    if parsed.scheme == "gs":
        from spottrain.cloud.gcp.gcs import GcsStore  # imports google-cloud-storage when used

        # google-cloud-storage's own override (the VMs get it from gcp.endpoints.storage).
        return GcsStore(
            parsed.bucket, parsed.path, api_endpoint=os.environ.get(GCS_ENDPOINT_ENV) or None
        )
    return LocalStore(parsed.path)
