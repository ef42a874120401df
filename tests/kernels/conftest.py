import pytest

from kernels import cpu as cpu_kernels
from srt.model_loader.default_model import cache_root


@pytest.fixture(scope="module")
def ops():
    """The compiled C++ CPU kernels, built (or loaded from the on-disk cache) on first use, not at
    collection; skipped without a compiler (the runtime then falls back to torch_native attention
    and dequantized weights)."""
    loaded = cpu_kernels.load(cache_root())
    if loaded is None:
        pytest.skip("no C++ compiler: the runtime falls back to torch_native and dequantized weights")
    return loaded
