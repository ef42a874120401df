// Row tiles: Q4_0 / Q4_1 weights repacked 16 rows at a time at load, so that one zmm of quants holds
// the same 4 inputs of 16 rows and a decode step's products need no shuffles (cpu_qvnni.h: tile_rows).
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
//
// The product per row and block is the file layout's (cpu_qvnni.h): d_w * d_x * sum(u * q_x) +
// m_w * s_x, with m_w = m (Q4_1) or -8 d (Q4_0), in float32 with one accumulator per term, summed
// over the blocks in order and the two accumulators added at the end.
#pragma once

#include <cstdint>
#include <cstring>

namespace radixserve_rowtiles {

constexpr int64_t kRows = 16;

// Block bytes of a row (the file's) and of a tile, and where a tile block's quants start.
inline int64_t row_block_bytes(bool has_min) { return has_min ? 20 : 18; }
inline int64_t tile_block_bytes(bool has_min) { return kRows * row_block_bytes(has_min); }
inline int64_t quant_offset(bool has_min) { return has_min ? 64 : 32; }

// 16 rows in the file's layout (row_bytes apart) into one tile at dst (nb blocks).
inline void repack_tile(const uint8_t* src, int64_t row_bytes, int64_t nb, bool has_min, uint8_t* dst) {
  const int64_t bs = row_block_bytes(has_min), tb = tile_block_bytes(has_min), qo = quant_offset(has_min);
  const int64_t qsrc = has_min ? 4 : 2;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t* out = dst + b * tb;
    for (int64_t i = 0; i < kRows; ++i) {
      const uint8_t* blk = src + i * row_bytes + b * bs;
      std::memcpy(out + 2 * i, blk, 2);
      if (has_min) std::memcpy(out + 32 + 2 * i, blk + 2, 2);
      for (int64_t t = 0; t < 4; ++t) std::memcpy(out + qo + t * 64 + 4 * i, blk + qsrc + 4 * t, 4);
    }
  }
}

// Row i of a tile (nb blocks) in the file's layout.
inline void tile_row(const uint8_t* tile, int64_t nb, bool has_min, int64_t i, uint8_t* row) {
  const int64_t bs = row_block_bytes(has_min), tb = tile_block_bytes(has_min), qo = quant_offset(has_min);
  const int64_t qdst = has_min ? 4 : 2;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* in = tile + b * tb;
    uint8_t* blk = row + b * bs;
    std::memcpy(blk, in + 2 * i, 2);
    if (has_min) std::memcpy(blk + 2, in + 32 + 2 * i, 2);
    for (int64_t t = 0; t < 4; ++t) std::memcpy(blk + qdst + 4 * t, in + qo + t * 64 + 4 * i, 4);
  }
}

// Row j of a weight whose first n16 rows are tiles, in the file's layout: a pointer into the weight
// for the untiled rows, else the row written to `tmp` (row_bytes).
inline const uint8_t* file_row(const uint8_t* wp, int64_t row_bytes, int64_t n16, bool has_min, int64_t j,
                               uint8_t* tmp) {
  if (j >= n16) return wp + j * row_bytes;
  tile_row(wp + (j / kRows) * kRows * row_bytes, row_bytes / row_block_bytes(has_min), has_min, j % kRows, tmp);
  return tmp;
}

}  // namespace radixserve_rowtiles
