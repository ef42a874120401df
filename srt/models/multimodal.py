"""Images in a prompt, as the model side sees them: the placeholder rows an image's embeddings fill,
the pad values that key those rows in the radix tree, and a byte-bounded cache of encoder outputs.

A processor (srt/multimodal) expands each image's placeholder into the model's token layout and
gives the image a `MultimodalItem`. In the request's `origin_input_ids` (the radix cache's key) the
rows the image's embeddings replace hold the item's `pad_value`, a number past the vocabulary derived
from the image's content hash: the same image at the same place shares KV, a different one never
does. The forward pass reads the real placeholder token there (`Req.model_ids`) and then overwrites
those rows with the encoder's output.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from srt.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce

# pad values live in [PAD_BASE, PAD_BASE + 2**30): past every vocabulary, inside int32 (req_to_token
# and the radix tree hold Python ints; the forward never embeds a pad)
PAD_BASE = 1 << 30


def pad_value(key: int) -> int:
    return PAD_BASE + key % (1 << 30)


@dataclass(eq=False)
class MultimodalItem:
    """One image of a request. `spans` are (start, length) runs of prompt positions its embedding
    rows fill, in order (Idefics3 interleaves tile markers between runs); `data` is what the model's
    encoder reads (pixel values and the like, on the CPU)."""

    key: int  # content hash of the image and how it was preprocessed
    token_id: int  # the model's placeholder token at those positions
    spans: list[tuple[int, int]]
    data: dict[str, torch.Tensor] = field(default_factory=dict)
    # M-RoPE (Qwen2-VL): the rows' (frames, rows, columns) grid; its rows take 3-D positions and
    # the text after the image resumes max(grid) positions on, not num_rows. None: one position a row
    grid: tuple[int, int, int] | None = None

    @property
    def pad_value(self) -> int:
        return pad_value(self.key)

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.spans)

    @property
    def position_delta(self) -> int:
        """How far the positions of what follows run ahead of its token index."""
        return max(self.grid) - self.num_rows if self.grid is not None else 0

    def rows_in(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(prompt position, count, first embedding row) of this item's rows in [start, end)."""
        out, row = [], 0
        for s, n in self.spans:
            lo, hi = max(s, start), min(s + n, end)
            if lo < hi:
                out.append((lo, hi - lo, row + lo - s))
            row += n
        return out


# ForwardBatch.mm_inputs: (batch row, count, item, first embedding row) for each run of rows that an
# item's embeddings fill in this extend
MMRun = tuple[int, int, MultimodalItem, int]


def mm_runs(items: Sequence[MultimodalItem], start: int, end: int, batch_offset: int) -> list[MMRun]:
    """The runs of one request extending prompt positions [start, end) from batch row batch_offset."""
    return [
        (batch_offset + pos - start, count, item, row) for item in items for pos, count, row in item.rows_in(start, end)
    ]


def mrope_positions(items: Sequence[MultimodalItem], start: int, end: int) -> torch.Tensor:
    """The M-RoPE positions [3, end - start] of token indices [start, end) of a sequence with these
    images: text (and generated tokens) count up alike on the three axes, shifted by the deltas of
    the images before it; an image's rows sit at its first row's position plus their (frame, row,
    column) in its grid."""
    pos = torch.arange(start, end).repeat(3, 1)
    shift = 0
    for item in sorted(items, key=lambda it: it.spans[0][0]):
        if item.grid is None:
            continue
        (first, n), t, h, w = item.spans[0], *item.grid
        assert len(item.spans) == 1 and t * h * w == n, "an M-RoPE image is one run of t * h * w rows"
        lo, hi = max(first, start), min(first + n, end)
        if lo < hi:
            k = torch.arange(lo - first, hi - first)
            grid = torch.stack((k // (h * w), k // w % h, k % w))
            pos[:, lo - start : hi - start] = first + shift + grid
        shift += item.position_delta
        if first + n < end:
            after = max(first + n, start)
            pos[:, after - start :] += item.position_delta
    return pos


def model_ids(ids: list[int], items: Sequence[MultimodalItem]) -> list[int]:
    """`ids` with each item's pad value replaced by its placeholder token (what is embedded)."""
    pads = {it.pad_value: it.token_id for it in items}
    return [pads.get(t, t) for t in ids]


class EncoderCache:
    """Encoder outputs by item key, least recently used first out, at most `capacity` bytes (0: off;
    an image whose rows span several prefill chunks is then encoded once per chunk)."""

    def __init__(self, capacity_bytes: int = 0):
        self.capacity = capacity_bytes
        self.entries: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def get(self, key: int) -> torch.Tensor | None:
        t = self.entries.get(key)
        if t is None:
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        return t

    def put(self, key: int, t: torch.Tensor) -> None:
        size = t.numel() * t.element_size()
        if size > self.capacity or key in self.entries:
            return
        while self.bytes + size > self.capacity:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self.entries[key] = t
        self.bytes += size


def encode_shared(
    items: list[MultimodalItem],
    encode: Callable[[list[MultimodalItem]], list[torch.Tensor]],
    hidden: int,
    dtype: torch.dtype,
    device,
) -> list[torch.Tensor]:
    """`encode(items)`, with tensor parallelism split by image over the ranks: each rank encodes its
    share (dealt largest first to the rank with the fewest rows so far) and one all-reduce of the
    rows (the others' zero) gives every rank all of them, exactly. Every rank sees the same batches
    and keeps the same cache, so all decide alike."""
    tp = get_tp_size()
    if tp == 1 or len(items) < 2:
        return encode(items)
    load, owner = [0] * tp, [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: -items[i].num_rows):
        owner[i] = min(range(tp), key=load.__getitem__)
        load[owner[i]] += items[i].num_rows
    rank = get_tp_rank()
    mine = [i for i in range(len(items)) if owner[i] == rank]
    starts = [0]
    for it in items:
        starts.append(starts[-1] + it.num_rows)
    rows = torch.zeros(starts[-1], hidden, dtype=dtype, device=device)
    if mine:
        for i, out in zip(mine, encode([items[i] for i in mine])):
            rows[starts[i] : starts[i + 1]] = out.to(dtype)
    rows = tensor_model_parallel_all_reduce(rows)
    return [rows[starts[i] : starts[i + 1]] for i in range(len(items))]


def merge_image_embeddings(
    embeds: torch.Tensor,
    runs: list[MMRun],
    encode: Callable[[list[MultimodalItem]], list[torch.Tensor]],
    cache: EncoderCache,
) -> torch.Tensor:
    """Write each run's encoder rows into `embeds` ([T, H]). The items not in the cache are encoded
    in one call (`encode` returns each item's [num_rows, H])."""
    outputs: dict[int, torch.Tensor] = {}
    missing: dict[int, MultimodalItem] = {}
    for _, _, item, _ in runs:
        if item.key in outputs or item.key in missing:
            continue
        if (hit := cache.get(item.key)) is not None:
            outputs[item.key] = hit
        else:
            missing[item.key] = item
    if missing:
        todo = list(missing.values())
        for item, out in zip(todo, encode_shared(todo, encode, embeds.shape[1], embeds.dtype, embeds.device)):
            if out.shape[0] != item.num_rows:
                raise RuntimeError(
                    f"the encoder gave {out.shape[0]} rows for an image with {item.num_rows} placeholders"
                )
            outputs[item.key] = out
            cache.put(item.key, out)
    rows = torch.cat([torch.arange(r, r + n) for r, n, _, _ in runs]).to(embeds.device)
    values = torch.cat([outputs[item.key][first : first + n] for _, n, item, first in runs])
    embeds[rows] = values.to(embeds.dtype)
    return embeds
