"""roseserve's version, as installed (pyproject.toml's)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("roseserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+source"
