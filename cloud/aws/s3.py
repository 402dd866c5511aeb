"""Amazon S3 as an :class:`~spottrain.cloud.storage.interface.ObjectStore`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, NoReturn

from spottrain.cloud.storage.errors import (
    BucketNotFound,
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

# --- Amazon S3 ------------------------------------------------------------------------------

_S3_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "SignatureDoesNotMatch",
        "AuthorizationHeaderMalformed",
        "AccountProblem",
        "403",
        "401",
    }
)
_S3_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "OperationAborted",
        "PreconditionFailed",
    }
)


class S3Store(_BucketStore):
    """Objects in an S3 bucket (or an S3-compatible endpoint) under a prefix.

    The sha256 of each object is its user metadata ``x-amz-meta-sha256``. Files at or above
    ``multipart_threshold`` go up and come down in ``multipart_chunksize`` parts, in parallel.

    Args:
        bucket: the bucket.
        prefix: the key prefix every key is relative to.
        session: a ``boto3.Session``; the default session when omitted.
        endpoint_url: an S3-compatible endpoint (MinIO, moto); path-style addressing is used.
        multipart_threshold: bytes from which transfers use multipart.
        multipart_chunksize: bytes per part (S3 requires at least 5 MiB).
        max_attempts: attempts per request, the first included (botocore's standard retry
            mode, with backoff, for throttling, 5xx and connection errors).

    Raises:
        MissingSdkError: boto3 is not installed.
        ValueError: a bad bucket, prefix or size.
    """

    scheme = "s3"

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        session: Any = None,
        endpoint_url: str | None = None,
        multipart_threshold: int = 64 * _MIB,
        multipart_chunksize: int = 16 * _MIB,
        max_attempts: int = 5,
    ) -> None:
        if not _BUCKET_RE.match(bucket):
            raise ValueError(f"bad S3 bucket name {bucket!r}")
        if multipart_chunksize < 5 * _MIB:
            raise ValueError(
                f"multipart_chunksize {multipart_chunksize} is below 5 MiB, S3's smallest part"
            )
        if multipart_threshold < 5 * _MIB:
            raise ValueError(f"multipart_threshold {multipart_threshold} is below 5 MiB")
        if max_attempts < 1:
            raise ValueError(f"max_attempts {max_attempts} must be at least 1")
        boto3 = lazy_import(
            "boto3",
            needs="S3 storage needs boto3, which is not installed",
            extra="aws",
            error=MissingSdkError,
        )
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = _normalise_store_prefix(prefix)
        # boto3 reads these itself, but an endpoint that is not AWS's needs path-style
        # addressing (no bucket.HOST names), so it is taken here (the VMs get it from the
        # spec's aws.endpoints.s3).
        endpoint_url = (
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or None
        )
        session = session if session is not None else boto3.Session()
        config = Config(
            retries={"total_max_attempts": max_attempts, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        self._client = session.client("s3", endpoint_url=endpoint_url, config=config)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=8,
        )
        self._bucket_seen = False

    def _auth_error(self, detail: str) -> StorageAuthError:
        return StorageAuthError(
            f"S3 refused the credentials for {self.url()} ({detail}); check AWS_PROFILE or "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the VM's instance profile), that they "
            f"have not expired, and that they may read and write s3://{self.bucket}"
        )

    def _classify(self, exc: BaseException, key: str) -> StorageError:
        from boto3.exceptions import RetriesExceededError, S3UploadFailedError
        from botocore import exceptions as bexc

        if isinstance(exc, S3UploadFailedError | RetriesExceededError):
            # boto3 re-raises a ClientError from a transfer as S3UploadFailedError without
            # `from`, and s3transfer's exhausted retries carry the last error as an attribute.
            inner = getattr(exc, "last_exception", None) or exc.__cause__ or exc.__context__
            if inner is not None and inner is not exc:
                return self._classify(inner, key)
            return StorageUnavailable(f"transfer of {self.url(key)} failed: {exc}")
        if isinstance(exc, bexc.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            message = str(err.get("Message", "") or code)
            if code == "NoSuchBucket":
                return BucketNotFound(self.bucket, f"S3 bucket {self.bucket!r} does not exist")
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                return ObjectNotFound(key, self.url(key))
            if code in _S3_AUTH_CODES or status in (401, 403):
                return self._auth_error(f"{code}: {message}")
            if code in _S3_TRANSIENT_CODES or status >= 500 or status in (408, 412, 429):
                return StorageUnavailable(f"S3 {code} for {self.url(key)}: {message}; retry")
            return StorageError(f"S3 refused a request for {self.url(key)}: {code}: {message}")
        if isinstance(exc, bexc.NoCredentialsError | bexc.PartialCredentialsError):
            return self._auth_error(str(exc))
        if isinstance(exc, bexc.CredentialRetrievalError | bexc.TokenRetrievalError):
            return self._auth_error(str(exc))
        if isinstance(exc, bexc.ConnectionError | bexc.HTTPClientError):
            return StorageUnavailable(f"cannot reach S3 for {self.url(key)}: {exc}")
        if isinstance(exc, bexc.BotoCoreError):
            return StorageError(f"S3 request for {self.url(key)} failed: {exc}")
        raise exc

    @contextlib.contextmanager
    def _errors(self, key: str) -> Iterator[None]:
        try:
            yield
        except StorageError:
            raise
        except Exception as exc:
            raise self._classify(exc, key) from exc

    def _raise_not_found(self, key: str) -> NoReturn:
        # HEAD answers a bare 404 for a missing bucket and a missing key alike.
        if not self._bucket_seen:
            try:
                with self._errors(""):
                    self._client.head_bucket(Bucket=self.bucket)
            except ObjectNotFound as exc:
                raise BucketNotFound(
                    self.bucket, f"S3 bucket {self.bucket!r} does not exist"
                ) from exc.__cause__
            self._bucket_seen = True
        raise ObjectNotFound(key, self.url(key))

    def _stat(self, key: str) -> ObjectInfo:
        from botocore.exceptions import ClientError

        try:
            with self._errors(key):
                head = self._client.head_object(Bucket=self.bucket, Key=self._full(key))
        except ObjectNotFound as exc:
            if isinstance(exc.__cause__, ClientError):
                self._raise_not_found(key)
            raise
        self._bucket_seen = True
        return ObjectInfo(
            key,
            int(head["ContentLength"]),
            head.get("Metadata", {}).get(SHA256_METADATA),
            str(head.get("ETag", "")),
        )

    def _put_fileobj(self, key: str, f: BinaryIO, size: int, sha256: str) -> None:
        # s3transfer closes the file it is given; the caller still needs its own.
        with self._errors(key), os.fdopen(os.dup(f.fileno()), "rb") as body:
            self._client.upload_fileobj(
                body,
                self.bucket,
                self._full(key),
                ExtraArgs={"Metadata": {SHA256_METADATA: sha256}},
                Config=self._transfer,
            )

    def _put_bytes(self, key: str, data: bytes, sha256: str) -> None:
        with self._errors(key):
            self._client.put_object(
                Bucket=self.bucket,
                Key=self._full(key),
                Body=data,
                Metadata={SHA256_METADATA: sha256},
            )

    def _download_to(self, key: str, tmp: Path) -> ObjectInfo:
        info = self._stat(key)
        with self._errors(key):
            self._client.download_file(
                self.bucket, self._full(key), str(tmp), Config=self._transfer
            )
        return info

    def _get_bytes(self, key: str) -> tuple[ObjectInfo, bytes]:
        with self._errors(key):
            resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key))
            data = resp["Body"].read()
        info = ObjectInfo(
            key,
            int(resp["ContentLength"]),
            resp.get("Metadata", {}).get(SHA256_METADATA),
            str(resp.get("ETag", "")),
        )
        return info, data

    def _list(self, prefix: str) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        keys: list[str] = []
        with self._errors(prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + prefix
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    keys.append(obj["Key"][len(base) :])
        return keys

    def _delete(self, key: str) -> None:
        with self._errors(key):
            self._client.delete_object(Bucket=self.bucket, Key=self._full(key))
