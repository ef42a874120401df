"""Small helpers shared across the runtime: device, dtype and memory queries."""

from __future__ import annotations

import logging
import math
import os
import random
import sys
from typing import TYPE_CHECKING

import psutil
import zmq

if TYPE_CHECKING:
    import torch

# torch, numpy and the kernels are imported where they are used: the server's main process imports
# this module before it starts its workers, and those should not wait for torch to load first.

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls run several times faster than fp32 on such CPUs (unless
    RADIXSERVE_CPU_ISA caps the runtime below avx512_bf16)."""
    from kernels.cpu import cpu_flags, cpu_isa_cap

    if cpu_isa_cap() not in (None, "avx512_bf16"):
        return False
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def cpu_int8_tiles() -> int:
    """When GGUF weights multiply int8 activations (kernels/csrc/cpu_qvnni.h, llama.cpp's numerics):
    Q4_0 / Q4_1 / Q8_0 in batches above the decode sizes (int8 tiles), and Q4_0 / Q4_1 at decode
    sizes on CPUs with AVX-512 VBMI as well (one streaming pass per weight row), and the row tiles
    (kernels/csrc/cpu_rowtiles.h). 0 never, 1 for bf16 / fp16 activations, 2 for float32 ones too,
    3 for bf16 / fp16 activations in batches of up to 160 rows. 1 on AVX-512 VNNI CPUs without AMX;
    3 on AMX CPUs, whose bf16 tiles win from ~160 rows on (on a 2-core Xeon with AMX: prefill of 512
    ~2200 tok/s against ~1830 on the int8 tiles) while the int8 paths win below (batch-64 decode of
    the default model 825-895 against 608-635 tok/s, batch 1 76 against 56); 0 where
    RADIXSERVE_CPU_ISA caps the kernels below avx512. RADIXSERVE_INT8_TILES=0 turns them off, =1 on for every dtype
    and size (where the CPU has VNNI)."""
    from kernels.cpu import cpu_flags, cpu_isa_cap

    forced = os.environ.get("RADIXSERVE_INT8_TILES", "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"RADIXSERVE_INT8_TILES must be 0 or 1; got {forced!r}")
    if forced == "0" or cpu_isa_cap() not in (None, "avx512", "avx512_bf16"):
        return 0
    flags = cpu_flags()
    if "avx512_vnni" not in flags or "avx512bw" not in flags:
        return 0
    if forced == "1":
        return 2
    return 3 if "amx_int8" in flags else 1


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto` is bfloat16 where the device multiplies bf16 fast, else float32."""
    import torch

    if dtype == "auto":
        if device == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return getattr(torch, DTYPES[dtype])


def available_memory_bytes(device: str) -> int:
    """Free memory a KV pool may draw from: device memory on CUDA, available RAM on CPU."""
    if device == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return free
    return psutil.virtual_memory().available


def set_random_seed(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def configure_logger(level: str = "info", prefix: str = "") -> None:
    fmt = f"[%(asctime)s{prefix}] %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper()), format=fmt, datefmt="%H:%M:%S", force=True)


def set_torch_threads(share: int = 1) -> None:
    """Use the cores this process may run on (containers often allow fewer than the host has),
    split evenly among `share` processes computing side by side (tensor-parallel ranks).
    An explicit OMP_NUM_THREADS wins."""
    import torch

    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        threads = int(os.environ["OMP_NUM_THREADS"])
        if threads * share > n:  # each of `share` processes runs that many: spinning threads then wait on each other
            logging.getLogger(__name__).warning(
                "OMP_NUM_THREADS=%d in each of %d computing processes oversubscribes the %d usable cores; "
                "expect a slowdown (unset it, or give %d)",
                threads,
                share,
                n,
                max(1, n // share),
            )
        torch.set_num_threads(threads)
        return
    torch.set_num_threads(max(1, n // share))


def zmq_socket(context, socket_type, endpoint: str, bind: bool):
    sock = context.socket(socket_type)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def die_with_parent() -> None:
    """Ask the kernel to kill this process when its parent dies (Linux), so a crashed or killed
    server never leaves orphan workers."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


HUGE_PAGE = 2 << 20


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 CPU tensor of `nbytes`, 2 MiB aligned, on transparent huge pages where the
    kernel grants them (a private anonymous mapping with `madvise(MADV_HUGEPAGE)`, which the
    common THP mode "madvise" requires; elsewhere the same mapping on 4 KiB pages). The OS hands
    out zeroed pages on first touch, so the memory costs nothing until it is used.

    Streaming reads from 4 KiB pages take a TLB miss every 4 KiB and stall the hardware
    prefetchers at each page boundary: on the 2-core Zen 4 VM a plain read loop ran at 27 GB/s
    from 4 KiB pages and 35 GB/s from huge pages, and a batch-1 decode step of the default model,
    which streams its weights once, from ~5.4 to ~4.8 ms (alternated runs)."""
    view = _huge_page_mapping(nbytes)
    return _tensor_over(view, 0, nbytes)


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or None where there
    is no such setting (not Linux, or no THP)."""
    import re

    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


def _huge_page_mapping(nbytes: int) -> memoryview:
    """A memoryview of `nbytes` at a 2 MiB boundary of a fresh private anonymous mapping, advised
    as huge pages (see `huge_page_zeros`); whatever holds it (or a slice) keeps the mapping alive."""
    import ctypes
    import mmap

    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not os.environ.get("RADIXSERVE_DISABLE_HUGE_PAGES"):  # =1: 4 KiB pages (A/B measurements)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except (AttributeError, OSError):  # no THP on this kernel / platform: 4 KiB pages
            pass
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -address % HUGE_PAGE
    return memoryview(mapping)[offset : offset + nbytes]


def _tensor_over(view: memoryview, offset: int, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over view[offset : offset + nbytes] with a storage of its own (no base, no
    storage shared with other tensors over the same mapping: torch.compile's freezing treats
    parameters that share a storage as aliases, and its compiled decode steps went wrong)."""
    import torch

    return torch.frombuffer(view[offset : offset + nbytes], dtype=torch.uint8)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """`torch.zeros`, except that on CPU the memory comes zeroed from the OS on first touch, so a
    multi-GB KV pool costs neither start-up time nor resident memory until it is used (zeroing
    8 GiB up front takes ~20 s on a 2-core VM); a buffer of a huge page or more is a fresh mapping
    on huge pages (`huge_page_zeros`), so attention streams it at the machine's full rate."""
    import torch

    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes >= HUGE_PAGE:
        return huge_page_zeros(nbytes).view(dtype).view(shape)
    import numpy as np  # below a huge page: calloc's memory, 64-byte aligned like torch's own

    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    offset = -raw.ctypes.data % 64
    return torch.from_numpy(raw[offset : offset + nbytes]).view(dtype).view(shape)


def move_to_huge_pages(tensors: list[torch.Tensor], min_bytes: int = 64 << 10) -> int:
    """Move CPU tensors of `min_bytes` or more into one huge-page mapping (see `huge_page_zeros`), in
    order, each in place and with a storage of its own (`Tensor.set_`: every reference, the kernels'
    weight lists included, sees the new memory); returns the bytes moved. Only a tensor that is not
    a view and spans its whole storage moves (a view keeps its base alive, and a part would stop
    sharing memory with the rest). The old storage is freed as each tensor moves and the C heap
    trimmed every 256 MiB, so the peak is the weights plus the largest tensor (an 8B model's LM
    head: 0.56 GB). Weights that a decode step streams once read faster from huge pages."""
    import torch

    movable, seen = [], set()
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous() or t.storage_offset():
            continue
        if t._base is not None:  # a view keeps its base, and so the old memory, alive
            continue
        storage = t.untyped_storage()
        nbytes = t.numel() * t.element_size()
        if nbytes < min_bytes or storage.nbytes() != nbytes or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        movable.append(t)
    if not movable:
        return 0
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in movable]  # each cache-line aligned
    release_free_heap()  # what loading left in the C heap, before the arena's pages add up
    arena = _huge_page_mapping(sum(sizes))
    offset = trimmed = 0
    with torch.no_grad():
        for t, size in zip(movable, sizes):
            piece = _tensor_over(arena, offset, t.numel() * t.element_size())
            piece.view(t.dtype).view(t.shape).copy_(t)
            t.set_(piece.untyped_storage(), 0, t.shape, t.stride())
            offset += size
            if offset - trimmed >= 256 << 20:  # old tensors below malloc's mmap threshold free into its heap
                release_free_heap()
                trimmed = offset
    release_free_heap()
    return offset


def rank_log_prefix(server_args, tp_rank: int, dp_rank: int = 0) -> str:
    return (f" DP{dp_rank}" if server_args.dp_size > 1 else "") + f" TP{tp_rank}"


def release_free_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's `malloc_trim`; a no-op elsewhere).

    Loading leaves hundreds of MB of freed-but-kept heap behind (checkpoint reads, tokenizer
    construction, temporary tensors below the mmap threshold); for an 8B GGUF model this was 0.37 GB
    of the scheduler's RSS."""
    import ctypes
    import ctypes.util

    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and other libcs have no malloc_trim
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def start_child_process(pipe_writer, log_level: str, log_prefix: str, build, ready_info=None):
    """The common start of a worker process: die with the parent, leave SIGTERM / SIGINT to it, dump
    stacks on SIGUSR1, log with a prefix, build the worker and report ready (with
    `ready_info(worker)`) or the error (then exit 1).

    Once built, the start-up's objects (modules, parameters, tokenizer tables: hundreds of thousands)
    are frozen out of the garbage collector's generations (`gc.freeze`), so its full collections,
    which the serving loop's allocations trigger every few seconds, scan only what the loop made
    (they took ~3 % of a batch-1 decode step of an 8B model before)."""
    import faulthandler
    import gc
    import signal
    import traceback

    die_with_parent()
    # Shutdown is the parent's: on SIGTERM / SIGINT it drains the in-flight requests, which needs the
    # workers, then stops them. A signal sent to the whole process group (Ctrl-C, `timeout`, systemd's
    # default KillMode) must not take a worker down before that (the drain's requests were lost).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    configure_logger(log_level, prefix=log_prefix)
    try:
        worker = build()
        gc.collect()
        gc.freeze()
        release_free_heap()
        pipe_writer.send({"status": "ready", **(ready_info(worker) if ready_info else {})})
        return worker
    except Exception as e:
        traceback.print_exc()
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        sys.exit(1)
