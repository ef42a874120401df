"""Weights and KV pools on transparent huge pages (srt/utils.py: huge_page_zeros, move_to_huge_pages)."""

import re

import pytest
import torch

from srt.utils import HUGE_PAGE, huge_page_zeros, lazy_zeros, move_to_huge_pages, thp_mode


def _anon_huge_kb(ptr: int) -> int:
    """AnonHugePages of the mapping that holds address `ptr` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if m := re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line):
                inside = int(m.group(1), 16) <= ptr < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_huge_page_zeros_is_aligned_zeroed_and_huge():
    buf = huge_page_zeros(3 * HUGE_PAGE + 100)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 100
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert int(buf.sum()) == 0
    buf.fill_(7)  # touch every page
    assert int(buf[-1]) == 7
    if thp_mode() in ("always", "madvise"):
        assert _anon_huge_kb(buf.data_ptr()) >= 2048, "the kernel's THP mode allows huge pages here"


def test_move_to_huge_pages_moves_in_place():
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 255, (300, 1000), dtype=torch.uint8, generator=g)
    rows = torch.randn(512, 576, generator=g).to(torch.bfloat16)
    small = torch.randn(16)  # under min_bytes: stays
    base = torch.randn(1024, 256)
    view = base[:512]  # a view keeps its base alive: stays
    weights = [big, rows]  # a kernel's list of its weight tensors: sees the move
    expect = [t.clone() for t in (big, rows, small, view)]
    old = [t.data_ptr() for t in (big, rows, small, view)]
    moved = move_to_huge_pages([big, rows, small, view, big])  # `big` twice: moved once
    assert moved == -(-big.numel() // 64) * 64 + rows.numel() * 2
    for t, e in zip((big, rows, small, view), expect):
        assert torch.equal(t, e)
    assert big.data_ptr() != old[0] and rows.data_ptr() != old[1]
    assert small.data_ptr() == old[2] and view.data_ptr() == old[3]
    assert big.data_ptr() % HUGE_PAGE == 0 and rows.data_ptr() % 64 == 0
    assert weights[0] is big and weights[1].data_ptr() == rows.data_ptr()
    # one mapping, each tensor its own storage (torch.compile's freezing takes a shared one for aliasing)
    assert rows.data_ptr() == big.data_ptr() + -(-big.numel() // 64) * 64
    assert big.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr()
    assert big.storage_offset() == rows.storage_offset() == 0 and big._base is None


def test_lazy_zeros_large_and_small():
    large = lazy_zeros((1024, 1024), torch.float32, "cpu")  # 4 MiB: its own huge-page mapping
    small = lazy_zeros((10, 3), torch.int32, "cpu")
    for t in (large, small):
        assert int(t.abs().sum()) == 0 and t.data_ptr() % 64 == 0
    assert large.data_ptr() % HUGE_PAGE == 0
    large[1000, 5] = 3.0
    assert float(large.sum()) == 3.0


@pytest.mark.parametrize("huge", [False, True])
def test_move_keeps_kernel_results(huge, monkeypatch):
    """A GGUF layer's quantized rows, moved after loading, give the same matmul."""
    if huge:
        monkeypatch.delenv("RADIXSERVE_DISABLE_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("RADIXSERVE_DISABLE_HUGE_PAGES", "1")
    w = torch.randn(256, 512)
    b = torch.randn(256)
    x = torch.randn(3, 512)
    layer = torch.nn.Linear(512, 256)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    before = layer(x)
    assert move_to_huge_pages(list(layer.parameters()), min_bytes=1) > 0
    assert isinstance(layer.weight, torch.nn.Parameter)
    assert torch.equal(layer(x), before)
