// Row tiles: Q4_0 / Q4_1 / Q8_0 weights repacked 16 rows at a time at load, so that one zmm of quants
// holds the same inputs of 16 rows and a decode step's products need no shuffles (cpu_qvnni.h:
// tile_rows for the 4-bit layers, tile_rows_q8 for a Q8_0 LM head).
//
// A weight stays a uint8 [N, row_bytes] tensor of the same bytes; its first N16 = N / 16 * 16 rows
// are tiles (the rest keep the file's layout). Tile t holds rows 16t .. 16t + 15 in the bytes those
// rows had, block after block; block b of a tile (16 x the type's block bytes):
//   d[16]  fp16, row i's scale                         (32 bytes)
//   m[16]  fp16, row i's minimum (Q4_1 only)           (32 bytes)
//   q[4][16][4]  quad t of row i: the row block's quant bytes 4t .. 4t + 3 (256 bytes)
// A quant byte's low nibble is input 4t + j of the block and its high nibble input 16 + 4t + j, as in
// the file, so quad t of the 16 rows times the broadcast activations x[4t .. 4t + 3] (low nibbles)
// and x[16 + 4t .. 16 + 4t + 3] (high nibbles) is one vpdpbusd each. The same 20 (Q4_1) or 18 (Q4_0)
// bytes per block: the file's size, and a row range of whole tiles is still a row range.
// Q8_0 (34 bytes a block): d[16] fp16 (32 bytes), then q[16][16][2]: pair p of row i, the row block's
// int8 inputs 2p and 2p + 1 (512 bytes), so one vpmovsxbw of 32 bytes is a zmm of 16 rows' int16 pairs.
//
// The product per row and block is the file layout's (cpu_qvnni.h): d_w * d_x * sum(u * q_x) +
// m_w * s_x, with m_w = m (Q4_1) or -8 d (Q4_0), in float32 with one accumulator per term, summed
// over the blocks in order and the two accumulators added at the end.
#pragma once

#include <cstdint>
#include <cstring>

namespace radixserve_rowtiles {

constexpr int64_t kRows = 16;

// `type`: the file's GGML type, 2 (Q4_0), 3 (Q4_1) or 8 (Q8_0).
// Block bytes of a row (the file's) and of a tile, and where a tile block's quants start.
inline int64_t row_block_bytes(int64_t type) { return type == 8 ? 34 : type == 3 ? 20 : 18; }
inline int64_t tile_block_bytes(int64_t type) { return kRows * row_block_bytes(type); }
inline int64_t quant_offset(int64_t type) { return type == 3 ? 64 : 32; }

// Where row i's bytes q .. q + n of a block go in a tile block (the inverse for reading back).
template <class Move>
inline void block_map(int64_t type, int64_t i, Move&& move) {
  move(2 * i, 0, 2);  // d
  if (type == 8) {
    for (int64_t p = 0; p < 16; ++p) move(32 + p * 32 + 2 * i, 2 + 2 * p, 2);
    return;
  }
  if (type == 3) move(32 + 2 * i, 2, 2);  // m
  const int64_t qo = quant_offset(type), qsrc = type == 3 ? 4 : 2;
  for (int64_t t = 0; t < 4; ++t) move(qo + t * 64 + 4 * i, qsrc + 4 * t, 4);
}

// 16 rows in the file's layout (row_bytes apart) into one tile at dst (nb blocks).
inline void repack_tile(const uint8_t* src, int64_t row_bytes, int64_t nb, int64_t type, uint8_t* dst) {
  const int64_t bs = row_block_bytes(type), tb = tile_block_bytes(type);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t i = 0; i < kRows; ++i) {
      const uint8_t* blk = src + i * row_bytes + b * bs;
      uint8_t* out = dst + b * tb;
      block_map(type, i, [&](int64_t to, int64_t from, int64_t n) { std::memcpy(out + to, blk + from, n); });
    }
}

// Row i of a tile (nb blocks) in the file's layout.
inline void tile_row(const uint8_t* tile, int64_t nb, int64_t type, int64_t i, uint8_t* row) {
  const int64_t bs = row_block_bytes(type), tb = tile_block_bytes(type);
  // the row's bytes are spread over the whole tile: every line requested at once, not one miss at a time
  for (int64_t off = 0; off < nb * tb; off += 64) __builtin_prefetch(tile + off, 0, 3);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* in = tile + b * tb;
    uint8_t* blk = row + b * bs;
    block_map(type, i, [&](int64_t to, int64_t from, int64_t n) { std::memcpy(blk + from, in + to, n); });
  }
}

// Row j of a weight whose first n16 rows are tiles, in the file's layout: a pointer into the weight
// for the untiled rows, else the row written to `tmp` (row_bytes).
inline const uint8_t* file_row(const uint8_t* wp, int64_t row_bytes, int64_t n16, int64_t type, int64_t j,
                               uint8_t* tmp) {
  if (j >= n16) return wp + j * row_bytes;
  tile_row(wp + (j / kRows) * kRows * row_bytes, row_bytes / row_block_bytes(type), type, j % kRows, tmp);
  return tmp;
}

}  // namespace radixserve_rowtiles
