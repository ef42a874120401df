"""radixserve runtime (import name `srt`)."""

from typing import TYPE_CHECKING

from srt.version import __version__

if TYPE_CHECKING:
    from srt.entrypoints.engine import Engine

__all__ = ["Engine", "__version__"]


def __getattr__(name: str):
    # Lazy: `import srt` stays cheap for tools that only need the version or server args.
    if name == "Engine":
        from srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)
