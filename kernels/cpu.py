"""The C++ CPU extension: built on first use with torch.utils.cpp_extension, cached on disk.

`load()` returns the `torch.ops.radixserve` namespace, or None (with one log line saying why)
when no compiler is available or the build fails; callers then fall back to torch_native.
The build is keyed by the sources and headers, torch's version and the CPU's flags, because it is compiled
for the host CPU (-march=native).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import time

import torch

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(__file__), "csrc")
SOURCES = [
    os.path.join(CSRC, name)
    for name in (
        "cpu_attention.cpp",
        "cpu_norm_act.cpp",
        "cpu_quant.cpp",
        "cpu_decode_layer.cpp",
        "cpu_lora.cpp",
        "cpu_moe.cpp",
        "cpu_mla.cpp",
        "cpu_membw.cpp",
        "cpu_sampling.cpp",
    )
]
HEADERS = [
    os.path.join(CSRC, name)
    for name in (
        "cpu_common.h",
        "cpu_int8.h",
        "cpu_bf16x2.h",
        "cpu_i16act.h",
        "cpu_sync.h",
        "cpu_rowtiles.h",
        "cpu_qvnni.h",
        "cpu_rowops.h",
        "cpu_lean.h",
        "cpu_sampling.h",
    )
]
# -fopenmp: ATen's parallel_for is a header template that runs serially unless the extension itself
# is compiled with OpenMP; linking it resolves to the libgomp.so.1 torch already loaded.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
LDFLAGS = ["-fopenmp"]
_state: dict = {}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The host CPU's feature flags (/proc/cpuinfo), empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


CPU_ISAS = ("scalar", "avx2", "avx512", "avx512_bf16")


def cpu_isa_cap() -> str | None:
    """RADIXSERVE_CPU_ISA: the best instruction set the quantized kernels may use (scalar, avx2,
    avx512, avx512_bf16), to reproduce an older CPU's code paths on a newer one; unset = the best
    this CPU has. torch's own kernels take ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA for the same."""
    value = os.environ.get("RADIXSERVE_CPU_ISA", "").strip().lower()
    if not value:
        return None
    if value not in CPU_ISAS:
        raise ValueError(f"RADIXSERVE_CPU_ISA must be one of {', '.join(CPU_ISAS)}; got {value!r}")
    return value


def _build_key() -> str:
    h = hashlib.sha256((torch.__version__ + " ".join(CFLAGS)).encode())
    for path in SOURCES + HEADERS:
        with open(path, "rb") as f:
            h.update(f.read())
    h.update(" ".join(sorted(cpu_flags())).encode())
    return h.hexdigest()[:16]


def build_dir(cache_root: str) -> str:
    return os.path.join(cache_root, "torch_extensions", f"radixserve_cpu_{_build_key()}")


def load(cache_root: str):
    """torch.ops.radixserve with the kernels registered, or None if they cannot be built. The build
    is cached under `cache_root` (the runtime's cache folder); the first call in a process decides."""
    if "ops" in _state:
        return _state["ops"]
    _state["ops"] = None
    if os.environ.get("RADIXSERVE_DISABLE_CPU_KERNELS"):
        logger.info("CPU kernels disabled by RADIXSERVE_DISABLE_CPU_KERNELS; attention falls back to torch_native")
        return None
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("no C++ compiler found; attention falls back to torch_native")
        return None
    from torch.utils.cpp_extension import load as load_extension

    directory = build_dir(cache_root)
    library = os.path.join(directory, "radixserve_cpu.so")
    cached = os.path.exists(library)
    os.makedirs(directory, exist_ok=True)
    start = time.perf_counter()
    try:
        if cached:  # the key covers sources, flags, torch and CPU: no need to ask ninja
            torch.ops.load_library(library)
        else:
            load_extension(
                name="radixserve_cpu",
                sources=SOURCES,
                build_directory=directory,
                is_python_module=False,
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                extra_include_paths=[CSRC],
                verbose=False,
            )
    except Exception as e:  # a compiler error, a missing header: serve anyway, without the kernels
        text = str(e).splitlines()
        lines = [x for x in text if "error:" in x] or [x for x in text if "error" in x.lower()] or [type(e).__name__]
        logger.warning("building the CPU kernels failed (%s); attention falls back to torch_native", lines[0].strip())
        return None
    logger.info(
        "CPU kernels %s in %.1f s (%s)",
        "loaded from cache" if cached else "built",
        time.perf_counter() - start,
        directory,
    )
    ops = torch.ops.radixserve
    cap = cpu_isa_cap()
    if cap is not None:
        best = ops.quant_isa("")
        if CPU_ISAS.index(cap) < CPU_ISAS.index(best):
            ops.quant_isa(cap)
            logger.info("RADIXSERVE_CPU_ISA=%s: quantized kernels limited to %s (this CPU: %s)", cap, cap, best)
    _state["ops"] = ops
    return ops


def num_decode_splits(batch: int, kv_heads: int, max_len: int) -> int:
    """Enough work items for every thread (two each), without splitting a context into pieces of
    fewer than ~64 positions. (Pieces of up to 256 positions: the default model's batch-1 step, 3 KV
    heads on 2 threads, left one thread waiting ~0.14 ms a step at the barrier after attention with
    a context of 128-256; split in two, ~0.12 ms faster on a 2-core Xeon.)"""
    threads = torch.get_num_threads()
    want = -(-2 * threads // max(1, batch * kv_heads))
    return max(1, min(want, -(-max_len // 128)))
