"""Importing an optional SDK only when it is used, with the install hint when it is missing.

The cloud SDKs (boto3, google-cloud-compute, google-cloud-storage) are extras of the
package: a module that needs one imports it through :func:`lazy_import` at the point of use, so
the module itself imports without the SDK and a user who lacks it is told which extra to
install::

    boto3 = lazy_import("boto3", needs="the AWS provider needs boto3", extra="aws")
"""

from __future__ import annotations

import importlib
from types import ModuleType


def install_hint(extra: str) -> str:
    """The command that installs spottrain's optional dependencies ``extra``."""
    return f"pip install 'spottrain[{extra}]'"


def lazy_import(
    module: str,
    *,
    needs: str,
    extra: str,
    error: type[ImportError] = ImportError,
    show_cause: bool = False,
) -> ModuleType:
    """Import ``module`` (a dotted name) and return it.

    Args:
        module: what to import, e.g. ``"boto3"`` or ``"google.cloud.storage"``.
        needs: the start of the message when it is missing, e.g. ``"S3 storage needs boto3"``.
        extra: the spottrain extra that brings it (``aws``, ``gcp``).
        error: the ImportError subclass to raise.
        show_cause: append the original import error's text in parentheses.

    Raises:
        ImportError: (or ``error``) ``"{needs}: pip install 'spottrain[{extra}]'"``, chained to
            the original error.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        message = f"{needs}: {install_hint(extra)}"
        if show_cause:
            message += f" ({exc})"
        raise error(message) from exc
