"""spottrain: train large models on spot GPU VMs as if they were reliable machines."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("spottrain")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
