"""KV endpoints over the Mooncake transfer engine (TCP on loopback, two engines in this process):
rows land in the destination's slots with the heads both sides hold, int8 scales included; the
fake backend moves nothing; bad calls raise TransferError."""

from __future__ import annotations

import pytest
import torch

from srt.disaggregation.messages import RankKV
from srt.disaggregation.transfer import KVEndpoint, TransferError, _clip_runs, _runs
from srt.mem_cache.memory_pool import MHATokenToKVPool

try:
    from mooncake.engine import TransferEngine  # noqa: F401
except ImportError as e:
    TransferEngine = None
    MOONCAKE_MISSING = str(e)
else:
    MOONCAKE_MISSING = ""
needs_mooncake = pytest.mark.skipif(TransferEngine is None, reason=f"Mooncake unavailable: {MOONCAKE_MISSING}")


def filled_pool(heads: int, kv_format: str | None = None, size: int = 96, page: int = 4) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(size, page, torch.float32, heads, 8, 3, "cpu", kv_format=kv_format)
    g = torch.Generator().manual_seed(heads)
    for kind in pool.slot_buffers():
        for buf in kind:
            if buf.dtype == torch.int8:
                buf.copy_(torch.randint(-127, 127, buf.shape, generator=g, dtype=torch.int8))
            else:
                buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    return pool


def test_runs_group_consecutive_slots():
    assert _runs([4, 5, 6, 9, 10, 3]) == [(0, 4, 3), (3, 9, 2), (5, 3, 1)]
    assert _clip_runs([(0, 4, 3), (3, 9, 2), (5, 3, 1)], 2, 5) == [(2, 6, 1), (3, 9, 2)]


@needs_mooncake
@pytest.mark.parametrize("kv_format", [None, "int8"])
def test_rows_land_in_the_reserved_slots_with_the_shared_heads(kv_format):
    src, dst_a, dst_b = filled_pool(4, kv_format), filled_pool(2, kv_format), filled_pool(2, kv_format)
    prefill = KVEndpoint("mooncake", src, 0, 4, "127.0.0.1", None, "prefill")
    # two decode ranks holding heads [0, 2) and [2, 4): the prefill rank's rows are regrouped
    rank_a = KVEndpoint("mooncake", dst_a, 0, 2, "127.0.0.1", None, "decode")
    rank_b = KVEndpoint("mooncake", dst_b, 2, 2, "127.0.0.1", None, "decode")
    src_slots = [5, 6, 7, 8, 21, 22, 40]
    dst_slots = [60, 61, 62, 63, 12, 13, 90]  # runs and a lone slot
    before_b = [b.clone() for kind in dst_b.slot_buffers() for b in kind]
    n = prefill.write(src_slots, rank_a.describe(), dst_slots)
    per_slot_head = sum(b.stride(1) * b.element_size() * len(kind) for kind in src.slot_buffers() for b in kind[:1])
    assert n == per_slot_head * 2 * len(src_slots)
    for kind_src, kind_dst in zip(src.slot_buffers(), dst_a.slot_buffers()):
        assert len(kind_src) == 3
        for s, d in zip(kind_src, kind_dst):
            assert torch.equal(s[src_slots][:, 0:2], d[dst_slots])
    # nothing else changed, and rank b got nothing yet
    untouched = [i for i in range(96 + 4) if i not in dst_slots]
    assert all(torch.equal(a, b) for a, b in zip(before_b, [b for kind in dst_b.slot_buffers() for b in kind]))
    prefill.write(src_slots, rank_b.describe(), dst_slots)
    for kind_src, kind_dst in zip(src.slot_buffers(), dst_b.slot_buffers()):
        for s, d in zip(kind_src, kind_dst):
            assert torch.equal(s[src_slots][:, 2:4], d[dst_slots])
            assert d[untouched].abs().sum() > 0  # the filler stays (no stray writes to zero it)
    if kv_format == "int8":
        assert len(src.slot_buffers()) == 4  # the per-(slot, head) scales travel too


@needs_mooncake
def test_part_rows_when_the_destination_holds_more_heads():
    src, dst = filled_pool(2), filled_pool(4)
    prefill = KVEndpoint("mooncake", src, 2, 2, "127.0.0.1", None, "prefill")  # heads [2, 4)
    decode = KVEndpoint("mooncake", dst, 0, 4, "127.0.0.1", None, "decode")
    before = [b.clone() for kind in dst.slot_buffers() for b in kind]
    prefill.write([1, 2, 3], decode.describe(), [10, 11, 12])
    after = [b for kind in dst.slot_buffers() for b in kind]
    srcs = [b for kind in src.slot_buffers() for b in kind]
    for s, b, a in zip(srcs, before, after):
        assert torch.equal(a[[10, 11, 12]][:, 2:4], s[[1, 2, 3]])
        assert torch.equal(a[[10, 11, 12]][:, 0:2], b[[10, 11, 12]][:, 0:2])  # the other heads untouched


@needs_mooncake
def test_bad_writes_raise():
    src, dst = filled_pool(2), filled_pool(2)
    prefill = KVEndpoint("mooncake", src, 0, 2, "127.0.0.1", None, "prefill")
    decode = KVEndpoint("mooncake", dst, 0, 2, "127.0.0.1", None, "decode")
    with pytest.raises(TransferError, match="source slots"):
        prefill.write([1, 2], decode.describe(), [3])
    other_layout = RankKV(**{**decode.describe().to_json(), "buffers": [[1]]})
    with pytest.raises(TransferError, match="layout"):
        prefill.write([1], other_layout, [3])
    gone = RankKV(**{**decode.describe().to_json(), "session": "127.0.0.1:1"})
    with pytest.raises(TransferError, match="failed"):
        prefill.write([1], gone, [3])


def test_fake_backend_moves_nothing():
    src, dst = filled_pool(2), filled_pool(2)
    before = dst.k_buffer[0].clone()
    prefill = KVEndpoint("fake", src, 0, 2, "127.0.0.1", None, "prefill")
    decode = KVEndpoint("fake", dst, 0, 2, "127.0.0.1", None, "decode")
    assert (
        prefill.write([1, 2], decode.describe(), [3, 4]) == 2 * 3 * 2 * 2 * 8 * 4
    )  # K, V x layers x slots x heads x dim x 4 B
    assert torch.equal(dst.k_buffer[0], before)
    assert RankKV.from_json(decode.describe().to_json()) == decode.describe()


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "want"),
    [
        (4, 2, 1, [(0, 2)]),
        (4, 2, 2, [(0, 1), (1, 2)]),
        (9, 3, 2, [(0, 1), (1, 3)]),  # 3 KV heads over 2 ranks: 1 + 2
        (4, 1, 2, [(0, 1), (0, 0)]),  # one KV head on both ranks: rank 0 writes it
        (8, 2, 4, [(0, 1), (0, 0), (1, 2), (1, 1)]),  # each KV head on two ranks
    ],
)
def test_each_kv_head_has_one_writer(heads, kv_heads, tp, want):
    from srt.disaggregation.setup import owned_heads

    assert [owned_heads(heads, kv_heads, tp, r) for r in range(tp)] == want


@needs_mooncake
def test_writes_larger_than_the_staging_buffer(monkeypatch):
    import srt.disaggregation.transfer as transfer

    monkeypatch.setattr(transfer, "STAGING_BYTES", 2048)  # 16 slots of one layer's K or V per flush
    src, dst = filled_pool(4, size=192), filled_pool(4, size=192)
    prefill = KVEndpoint("mooncake", src, 0, 4, "127.0.0.1", None, "prefill")
    decode = KVEndpoint("mooncake", dst, 0, 4, "127.0.0.1", None, "decode")
    src_slots = list(range(10, 50))  # 40 slots: three chunks, a flush per layer and kind
    dst_slots = list(range(150, 170)) + list(range(60, 80))  # two runs, split across chunks
    prefill.write(src_slots, decode.describe(), dst_slots)
    for kind_src, kind_dst in zip(src.slot_buffers(), dst.slot_buffers()):
        for s, d in zip(kind_src, kind_dst):
            assert torch.equal(s[src_slots], d[dst_slots])
