"""radixserve runtime (import name `srt`)."""

from srt.version import __version__

__all__ = ["__version__"]
