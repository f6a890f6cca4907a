"""The installed package's version. pyproject.toml holds the one copy; this reads it from the
installed distribution's metadata."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("hybridgemm")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
