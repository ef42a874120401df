"""Batch-invariant attention for `--enable-deterministic-inference` (docs/deterministic.md).

A query row's output must not depend on the batch around it: on which other requests run, on how
its prompt was cut into chunks, on whether its prefix came from the radix cache, or on whether it
is a decode step or one row of a prefill. So every row is computed the same way:

- its keys are read back from the pool (after this step's are written) in tiles of `TILE`
  positions aligned at position 0, the positions past the row (causal) or past the tile masked;
- scores and the weighted values are batched GEMMs per (KV head, tile), [TILE, d] x [d, columns]
  and [d + 1, TILE] x [TILE, columns], a row's query heads being `group` columns (V carries a
  column of ones, so the softmax's denominator comes out of the same GEMM). The rows of a prefill
  chunk sit side by side; the width is padded to a multiple of COLS, as BLAS treats narrow
  right-hand sides differently, and a start-up probe checks that the width then changes no
  column's bits (else every row runs alone);
- the row's maximum is taken over all its tiles (exact in any order), exp runs in float64 (its
  vectorized and scalar forms agree once rounded to float32), and the tiles' partial sums are
  added one tile after the other, in position order. A masked tile adds exact zeros.

Float32 throughout, whatever the model's dtype. Slower than the fused kernels: docs/deterministic.md
gives the figures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srt.layers.attention.base_attn_backend import AttentionBackend
from srt.layers.attention.registry import register_attention_backend

logger = logging.getLogger(__name__)

TILE = 64  # key positions per tile
COLS = 16  # the right-hand sides' widths are multiples of this: BLAS takes other paths for narrow ones
MAX_ROWS = 32  # prefill rows of one request computed in one batched matmul


@dataclass
class _Group:
    """P pieces of n query rows each, every piece the rows of one request at consecutive positions:
    a decode batch is one group (n = 1, a piece per request), a prefill chunk a group per MAX_ROWS
    rows. Pieces with fewer tiles than the group's are padded with masked tiles (exact zeros)."""

    rows: torch.Tensor  # [P * n] rows of the batch's q, piece by piece
    p: int
    n: int
    tiles: int
    kv_index: torch.Tensor  # [P * kv_heads * tiles * TILE] rows of the pool viewed as [slots * kv_heads, d]
    allowed: torch.Tensor  # [P, n, 1, tiles, TILE, 1] bool: key position <= the row's position


def _group(fb, pieces: list[tuple[int, int, int, int]], kv_heads: int) -> _Group:
    """pieces: (request index, first q row, first position, rows)."""
    req_to_token = fb.req_to_token_pool.req_to_token
    device = fb.seq_lens.device
    n = pieces[0][3]
    tiles = max((pos0 + n - 1) // TILE + 1 for _, _, pos0, _ in pieces)
    span = tiles * TILE
    heads = torch.arange(kv_heads, device=device).unsqueeze(1)
    key_pos = torch.arange(span, device=device).view(1, tiles, TILE)
    index, allowed, rows = [], [], []
    for i, q0, pos0, _ in pieces:
        last = pos0 + n - 1
        slots = req_to_token[fb.req_pool_indices[i], : last + 1].long()
        slots = F.pad(slots, (0, span - slots.numel()))  # slot 0 past the row: masked
        index.append((slots.unsqueeze(0) * kv_heads + heads).reshape(-1))
        row_pos = torch.arange(pos0, pos0 + n, device=device).view(n, 1, 1)
        allowed.append((key_pos <= row_pos).view(n, 1, tiles, TILE, 1))
        rows.append(torch.arange(q0, q0 + n, device=device))
    return _Group(torch.cat(rows), len(pieces), n, tiles, torch.cat(index), torch.stack(allowed))


def _groups(fb, rows_per_piece: int) -> list[_Group]:
    kv_heads = fb.token_to_kv_pool.head_num
    decode = fb.forward_mode.is_decode()
    singles, groups = [], []
    for i in range(fb.batch_size):
        seq = int(fb.seq_lens_cpu[i])
        n_new = 1 if decode else int(fb.extend_seq_lens_cpu[i])
        q0 = i if decode else int(fb.extend_start_loc_cpu[i])
        first = seq - n_new
        for start in range(0, n_new, rows_per_piece):
            n = min(rows_per_piece, n_new - start)
            piece = (i, q0 + start, first + start, n)
            if n == 1:
                singles.append(piece)
            else:
                groups.append(_group(fb, [piece], kv_heads))
    if singles:  # every one-row piece (decode rows, one-token extends) in one batched computation
        groups.append(_group(fb, singles, kv_heads))
    return groups


def _columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., width] padded with zero columns to a multiple of COLS."""
    padded = -(-width // COLS) * COLS
    return F.pad(x, (0, padded - width)) if padded > width else x


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [P, n, kv_heads, group, d]: P pieces of n rows, a piece's rows of one request; k, v [P,
    kv_heads, tiles, TILE, d] each piece's keys; allowed [P, n, 1, tiles, TILE, 1]. Returns [P, n,
    kv_heads, group, d], each row's bits independent of P, n, the tiles past its own and the other rows."""
    p, n, hkv, group, d = q.shape
    tiles, width = k.shape[2], n * group
    # right-hand side [P, kv_heads, tiles, d, columns]: a piece's rows side by side, padded
    rhs = _columns(q.permute(0, 2, 4, 1, 3).reshape(p, hkv, 1, d, width), width)
    scores = torch.matmul(k, rhs.expand(p, hkv, tiles, d, rhs.shape[-1]))[..., :width]  # [P, hkv, tiles, TILE, n*g]
    scores = scores.reshape(p, hkv, tiles, TILE, n, group).permute(0, 4, 1, 2, 3, 5).contiguous()
    scores = scores * scaling  # [P, n, hkv, tiles, TILE, g]
    scores = scores.masked_fill(~allowed, float("-inf"))
    top = scores.amax(dim=(3, 4), keepdim=True)  # every row sees position 0: finite
    # in float64, rounded to float32: the vectorized and the scalar exp (an elementwise kernel's
    # tail, which moves with the tensor's size) may differ in the last bit of a double, not of a float
    probs = torch.exp((scores - top).double()).float()
    ones = torch.ones(p, hkv, tiles, TILE, 1, dtype=v.dtype, device=v.device)
    lhs = torch.cat([v, ones], dim=-1).transpose(-1, -2)  # [P, hkv, tiles, d + 1, TILE]
    rhs = _columns(probs.permute(0, 2, 3, 4, 1, 5).reshape(p, hkv, tiles, TILE, width), width)
    part = torch.matmul(lhs, rhs)[..., :width]  # [P, hkv, tiles, d + 1, n * group]
    acc = part[:, :, 0]
    for t in range(1, tiles):  # in position order; a tile past a row's own adds exact zeros
        acc = acc + part[:, :, t]
    out = acc[:, :, :d] / acc[:, :, d:]  # [P, hkv, d, n * group]
    return out.reshape(p, hkv, d, n, group).permute(0, 3, 1, 4, 2)


def _columns_invariant() -> bool:
    """Whether the batched matmuls above give a column the same bits whatever the (padded) width
    and the number of tiles, on this machine's BLAS. Then a prefill chunk's rows run together; else
    one row at a time."""
    g = torch.Generator().manual_seed(7)
    for lhs_shape in ((3, 4, TILE, 64), (3, 4, 65, TILE)):
        lhs = torch.randn(*lhs_shape, generator=g)
        rhs = torch.randn(lhs_shape[0], lhs_shape[1], lhs_shape[-1], 6 * COLS, generator=g)
        full = torch.matmul(lhs, rhs)
        for lo, hi in ((0, COLS), (COLS, 2 * COLS), (2 * COLS, 5 * COLS), (0, 3 * COLS)):
            if not torch.equal(torch.matmul(lhs, rhs[..., lo:hi].contiguous()), full[..., lo:hi]):
                return False
        if not torch.equal(torch.matmul(lhs[:, :1], rhs[:, :1, :, :COLS].contiguous()), full[:, :1, :, :COLS]):
            return False
    return True


@register_attention_backend("deterministic")
class DeterministicAttnBackend(AttentionBackend):
    def __init__(self, model_runner=None):
        self.groups: list[_Group] = []
        self.rows_per_piece = MAX_ROWS if _columns_invariant() else 1
        logger.info(
            "Deterministic attention: %d-position key tiles, %d prefill row(s) per matmul",
            TILE,
            self.rows_per_piece,
        )

    def init_forward_metadata(self, fb) -> None:
        self.groups = _groups(fb, self.rows_per_piece)

    def _run(self, q, layer, fb) -> torch.Tensor:
        hkv, d = layer.tp_k_head_num, layer.head_dim
        group = layer.tp_q_head_num // hkv
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        qf = q.float()
        for g in self.groups:
            k, v = fb.token_to_kv_pool.gather(layer.layer_id, g.kv_index, torch.float32)
            k, v = k.view(g.p, hkv, g.tiles, TILE, d), v.view(g.p, hkv, g.tiles, TILE, d)
            qr = qf.index_select(0, g.rows).view(g.p, g.n, hkv, group, d)
            out[g.rows] = attend(qr, k, v, g.allowed, layer.scaling).reshape(g.p * g.n, -1)
        return out.to(q.dtype)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        return self._run(q, layer, fb)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache: bool = True) -> torch.Tensor:
        if save_kv_cache:
            self.save_kv(layer, fb, k, v)
        return self._run(q, layer, fb)
