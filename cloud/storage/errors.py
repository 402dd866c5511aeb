"""The errors every object store raises (a subclass of :class:`StorageError` each)."""

from __future__ import annotations


class StorageError(Exception):
    """An object store refused or failed a request; the message says what and why."""


class ObjectNotFound(StorageError):
    """The object does not exist (the bucket does)."""

    def __init__(self, key: str, url: str | None = None) -> None:
        self.key = key
        self.url = url or key
        super().__init__(f"no object at {self.url}")


class BucketNotFound(StorageError):
    """The bucket (or a local store's directory) does not exist."""

    def __init__(self, bucket: str, detail: str = "") -> None:
        self.bucket = bucket
        super().__init__(detail or f"bucket {bucket!r} does not exist; create it or fix the URL")


class StorageAuthError(StorageError):
    """Credentials are missing, expired or lack permission; the message says how to fix it."""


class StorageUnavailable(StorageError):
    """A transient failure (timeout, 5xx, throttling, an object replaced mid-read): retry."""


class SourceChanged(StorageUnavailable):
    """A local file or directory changed while it was uploaded (a newer commit of the same
    checkpoint replaced it): what was sent is withdrawn; upload it again."""


class CorruptObject(StorageError):
    """An object's bytes do not match the sha256 recorded when it was written."""

    def __init__(self, key: str, detail: str) -> None:
        self.key = key
        super().__init__(detail)


class IncompleteCopy(StorageError):
    """A directory copy has no commit marker: its upload died, or is still running."""

    def __init__(self, prefix: str, detail: str) -> None:
        self.prefix = prefix
        super().__init__(detail)


class MissingSdkError(StorageError, ImportError):
    """The cloud SDK a store needs is not installed; the message names the extra to install."""
