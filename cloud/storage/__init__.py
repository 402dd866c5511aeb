"""Object storage for checkpoint copies and code archives: S3, GCS, or a local directory.

A job that moves to another zone or cloud takes its newest checkpoint with it through object
storage: :func:`upload_dir` copies a committed checkpoint directory to a store, and
:func:`download_dir` fetches it back on the new fleet. ``spottrain up`` also uploads the job's
code there (see :mod:`spottrain.cloud.code_archive`).

Stores are opened from a URL (:func:`spottrain.cloud.stores.open_store`)::

    store = open_store("s3://my-bucket/runs/llama")      # or gs://..., file:///..., a path
    report = upload_dir(store, Path("/ckpt/step-000000120"), "ckpt/step-000000120")
    download_dir(store, "ckpt/step-000000120", Path("/ckpt/step-000000120"))

The cloud SDKs (boto3, google-cloud-storage) are imported only when a store of that kind is
built, so this package imports without them (the S3 store lives in
:mod:`spottrain.cloud.aws.s3`, the GCS store in :mod:`spottrain.cloud.gcp.gcs`).
"""

from spottrain.cloud.storage.errors import (
    BucketNotFound,
    CorruptObject,
    IncompleteCopy,
    MissingSdkError,
    ObjectNotFound,
    SourceChanged,
    StorageAuthError,
    StorageError,
    StorageUnavailable,
)
from spottrain.cloud.storage.factory import StoreUrl, parse_store_url
from spottrain.cloud.storage.interface import (
    DEFAULT_COMMIT_MARKER,
    SHA256_METADATA,
    ObjectInfo,
    ObjectStore,
    validate_key,
)
from spottrain.cloud.storage.local import LocalStore
from spottrain.cloud.storage.store_base import file_sha256
from spottrain.cloud.storage.sync import UploadReport, download_dir, list_dirs, upload_dir

__all__ = [
    "DEFAULT_COMMIT_MARKER",
    "SHA256_METADATA",
    "BucketNotFound",
    "CorruptObject",
    "IncompleteCopy",
    "LocalStore",
    "MissingSdkError",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "SourceChanged",
    "StorageAuthError",
    "StorageError",
    "StorageUnavailable",
    "StoreUrl",
    "UploadReport",
    "download_dir",
    "file_sha256",
    "list_dirs",
    "parse_store_url",
    "upload_dir",
    "validate_key",
]
