"""Errors about the model the runtime is asked to load (standard library only: the launcher raises
them before any worker imports torch)."""


class ModelLoadError(RuntimeError):
    """A model path, file or config the runtime cannot load; the message names the path and why."""
