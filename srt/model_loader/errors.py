class ModelLoadError(RuntimeError):
    """A model path, file or config the runtime cannot load; the message names the path and why."""
