"""Google Cloud Storage as an :class:`~spottrain.cloud.storage.interface.ObjectStore`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from spottrain.cloud.storage.errors import (
    BucketNotFound,
    CorruptObject,
    MissingSdkError,
    ObjectNotFound,
    StorageAuthError,
    StorageError,
    StorageUnavailable,
)
from spottrain.cloud.storage.interface import (
    _BUCKET_RE,
    _MIB,
    SHA256_METADATA,
    ObjectInfo,
    _normalise_store_prefix,
)
from spottrain.cloud.storage.store_base import _BucketStore
from spottrain.lazy_import import lazy_import

_GCS_CHUNK_QUANTUM = 256 * 1024


class GcsStore(_BucketStore):
    """Objects in a Google Cloud Storage bucket under a prefix.

    The sha256 of each object is its custom metadata ``sha256``. Objects above 8 MiB go up
    in a resumable upload of ``chunk_size`` chunks (the client's fixed threshold); downloads
    are single streams, which the client checks against the object's CRC32C.

    Args:
        bucket: the bucket.
        prefix: the key prefix every key is relative to.
        client: a ``google.cloud.storage.Client``; built from the other arguments if omitted.
        credentials: ``google.auth`` credentials; Application Default Credentials if omitted.
        project: the billing project, if the bucket needs one (requester pays).
        api_endpoint: another endpoint (an emulator), e.g. ``http://127.0.0.1:4443``.
        chunk_size: bytes per resumable-upload request, a multiple of 256 KiB.
        retry_timeout_s: how long the client retries transient errors (429, 5xx, connection
            errors) with backoff before giving up; 0 disables retries.

    Raises:
        MissingSdkError: google-cloud-storage is not installed.
        StorageAuthError: no credentials were given and none could be found.
        ValueError: a bad bucket, prefix or chunk size.
    """

    scheme = "gs"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        client: Any = None,
        credentials: Any = None,
        project: str | None = None,
        api_endpoint: str | None = None,
        chunk_size: int = 32 * _MIB,
        retry_timeout_s: float = 120.0,
    ) -> None:
        if not _BUCKET_RE.match(bucket):
            raise ValueError(f"bad GCS bucket name {bucket!r}")
        if chunk_size <= 0 or chunk_size % _GCS_CHUNK_QUANTUM:
            raise ValueError(f"chunk_size {chunk_size} is not a positive multiple of 256 KiB")
        if retry_timeout_s < 0:
            raise ValueError(f"retry_timeout_s {retry_timeout_s} is negative")
        storage = lazy_import(
            "google.cloud.storage",
            needs="GCS storage needs google-cloud-storage, which is not installed",
            extra="gcp",
            error=MissingSdkError,
        )
        from google.cloud.storage.retry import DEFAULT_RETRY

        self.bucket = bucket
        self.prefix = _normalise_store_prefix(prefix)
        if client is None:
            try:
                # project=None says "no project needed" (objects live in a bucket that exists);
                # leaving it out makes the client insist on finding a default project.
                client = storage.Client(
                    project=project,
                    credentials=credentials,
                    client_options={"api_endpoint": api_endpoint} if api_endpoint else None,
                )
            except Exception as exc:
                raise self._classify(exc, "") from exc
        self._client = client
        self._bucket = client.bucket(bucket)
        self._chunk_size = chunk_size
        self._retry = DEFAULT_RETRY.with_timeout(retry_timeout_s) if retry_timeout_s else None

    def _auth_error(self, detail: str) -> StorageAuthError:
        return StorageAuthError(
            f"GCS refused the credentials for {self.url()} ({detail}); run `gcloud auth "
            "application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a service "
            "account key, or give the VM's service account roles/storage.objectAdmin on "
            f"gs://{self.bucket}"
        )

    def _classify(self, exc: BaseException, key: str) -> StorageError:
        import requests
        from google.api_core import exceptions as gexc
        from google.auth import exceptions as auth_exc
        from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

        if isinstance(exc, gexc.RetryError) and exc.cause is not None:
            return self._classify(exc.cause, key)
        if isinstance(exc, DataCorruption):
            return CorruptObject(
                key, f"{self.url(key)} failed the download's CRC32C/MD5 check: {exc}"
            )
        if isinstance(exc, gexc.NotFound):
            if "bucket does not exist" in str(exc).lower():
                return BucketNotFound(self.bucket, f"GCS bucket {self.bucket!r} does not exist")
            return ObjectNotFound(key, self.url(key))
        if isinstance(exc, gexc.Unauthorized | gexc.Forbidden):
            return self._auth_error(str(exc))
        if isinstance(exc, auth_exc.DefaultCredentialsError | auth_exc.RefreshError):
            return self._auth_error(str(exc))
        if isinstance(exc, gexc.PreconditionFailed):
            return StorageUnavailable(f"{self.url(key)} was replaced while it was read; retry")
        if isinstance(exc, gexc.GoogleAPICallError) and (
            exc.code in (408, 429) or (exc.code or 0) >= 500
        ):
            return StorageUnavailable(f"GCS is unavailable for {self.url(key)}: {exc}; retry")
        if isinstance(exc, requests.ConnectionError | requests.Timeout | auth_exc.TransportError):
            return StorageUnavailable(f"cannot reach GCS for {self.url(key)}: {exc}")
        if isinstance(exc, ConnectionError | TimeoutError):
            return StorageUnavailable(f"connection to GCS failed for {self.url(key)}: {exc}")
        if isinstance(exc, InvalidResponse):
            status = getattr(exc.response, "status_code", 0)
            if status in (408, 429) or status >= 500:
                return StorageUnavailable(f"GCS answered {status} for {self.url(key)}; retry")
            return StorageError(f"GCS answered {status} for {self.url(key)}: {exc}")
        if isinstance(exc, gexc.GoogleAPICallError):
            return StorageError(f"GCS refused a request for {self.url(key)}: {exc}")
        raise exc

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            raise self._classify(exc, key) from exc

    def _info(self, key: str, blob: Any) -> ObjectInfo:
        sha256 = (blob.metadata or {}).get(SHA256_METADATA)
        return ObjectInfo(key, int(blob.size or 0), sha256, str(blob.generation))

    def _reloaded(self, key: str) -> Any:
        blob = self._bucket.blob(self._full(key))
        with self._errors(key):
            blob.reload(retry=self._retry)
        return blob

    def _stat(self, key: str) -> ObjectInfo:
        return self._info(key, self._reloaded(key))

    def _put_fileobj(self, key: str, f: BinaryIO, size: int, sha256: str) -> None:
        blob = self._bucket.blob(self._full(key), chunk_size=self._chunk_size)
        blob.metadata = {SHA256_METADATA: sha256}
        with self._errors(key):
            blob.upload_from_file(
                f, size=size, content_type="application/octet-stream", retry=self._retry
            )

    def _put_bytes(self, key: str, data: bytes, sha256: str) -> None:
        blob = self._bucket.blob(self._full(key))
        blob.metadata = {SHA256_METADATA: sha256}
        with self._errors(key):
            blob.upload_from_string(
                data, content_type="application/octet-stream", retry=self._retry
            )

    def _download_to(self, key: str, tmp: Path) -> ObjectInfo:
        # A blob without chunk_size downloads in one stream, which the client verifies
        # against the CRC32C; a chunked (ranged) download would skip that check.
        blob = self._reloaded(key)
        with self._errors(key), open(tmp, "wb") as f:
            blob.download_to_file(f, if_generation_match=blob.generation, retry=self._retry)
        return self._info(key, blob)

    def _get_bytes(self, key: str) -> tuple[ObjectInfo, bytes]:
        blob = self._reloaded(key)
        with self._errors(key):
            data = blob.download_as_bytes(if_generation_match=blob.generation, retry=self._retry)
        return self._info(key, blob), data

    def _list(self, prefix: str) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        with self._errors(prefix):
            blobs = self._client.list_blobs(self.bucket, prefix=base + prefix, retry=self._retry)
            return [blob.name[len(base) :] for blob in blobs]

    def _delete(self, key: str) -> None:
        try:
            with self._errors(key):
                self._bucket.blob(self._full(key)).delete(retry=self._retry)
        except ObjectNotFound:
            pass


# --- directory copies -----------------------------------------------------------------------
