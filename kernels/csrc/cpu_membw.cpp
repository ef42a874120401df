// The machine's memory read bandwidth, for benchmark/bench_roofline.py: stream_read(buf) reads every byte
// of a uint8 buffer once, with all threads (each a contiguous slice, two 64-byte loads in flight per
// step), and returns the XOR of its 64-bit words (so the reads cannot be dropped; the tests check the
// value). torch.sum, the other reader there, adds a float per 4 bytes and on a 2-core Zen 4 read 28-31
// GB/s where this loop (and the 4-bit GEMVs) read 38-44: a roofline needs the machine's rate, not
// one library's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_sync.h"
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

uint64_t xor_range(const uint8_t* p, int64_t n) {
  uint64_t acc = 0;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
  for (; i + 128 <= n; i += 128) {
    a = _mm512_xor_si512(a, _mm512_loadu_si512(p + i));
    b = _mm512_xor_si512(b, _mm512_loadu_si512(p + i + 64));
  }
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_xor_si512(a, b));
  for (uint64_t v : lanes) acc ^= v;
#elif defined(__AVX2__)
  __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
  for (; i + 64 <= n; i += 64) {
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    b = _mm256_xor_si256(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_xor_si256(a, b));
  for (uint64_t v : lanes) acc ^= v;
#endif
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    acc ^= v;
  }
  return acc;
}

}  // namespace

// XOR of the buffer's 64-bit words (a length not a multiple of 8 leaves its last bytes out).
int64_t stream_read(const at::Tensor& buf) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "stream_read: a contiguous CPU uint8 tensor");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t words = buf.numel() / 8;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), words / 4096));
  std::vector<uint64_t> part(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t w0 = words * t / threads, w1 = words * (t + 1) / threads;
      part[t] = xor_range(p + 8 * w0, 8 * (w1 - w0));
    }
  });
  uint64_t acc = 0;
  for (uint64_t v : part) acc ^= v;
  int64_t out;
  std::memcpy(&out, &acc, 8);
  return out;
}

// Nanoseconds per OpenMP barrier of torch's threads (`rounds` of them in one parallel region; 0 with one
// thread): where the threads sit relative to each other. On the 2-core Zen 4 VM it reads ~0.26-0.31 us
// while the memory reads ~33-36 GB/s and ~0.50-0.60 us while it reads ~55-63: the host runs the two
// vCPUs on one CCD (one link to the memory, a shared L3) or on two (two links; every line one thread
// writes and the other reads crosses between them), which bench_roofline.py reports as the state.
double barrier_ns(int64_t rounds) {
  const int64_t threads = at::get_num_threads();
  if (threads < 2 || rounds < 1) return 0.0;
  double ns = 0.0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
  {
#pragma omp barrier
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < rounds; ++r) {
#pragma omp barrier
    }
    if (omp_get_thread_num() == 0)
      ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / rounds;
  }
#endif
  return ns;
}

// stream_read's bytes in phases: the first phases[0] bytes of buf, then the next phases[1], ..., shared
// out as the decode stack shares a phase's rows (each thread its own range's 4 KB units in spans of up
// to 48 KB, its last two one by one, which a thread that finished first may take) and all threads
// meeting at the decode stack's barrier after each phase: how a batch-1 decode step reads its weights
// and KV, layer by layer and projection by projection. The XOR of the words read. bench_roofline.py
// times it with the step's own phases: what a step in that structure could reach with no arithmetic.
int64_t phased_read(const at::Tensor& buf, at::IntArrayRef phases) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kByte && buf.is_contiguous(),
              "phased_read: a contiguous CPU uint8 tensor");
  int64_t total = 0;
  for (int64_t n : phases) {
    TORCH_CHECK(n >= 0 && n % 64 == 0, "phased_read: phases must be multiples of 64 bytes, got ", n);
    total += n;
  }
  TORCH_CHECK(total <= buf.numel(), "phased_read: phases of ", total, " bytes exceed the buffer's ", buf.numel());
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<uint64_t> part(threads, 0);
  radixserve_lean::Meet meet;
  radixserve_lean::Steal steal(threads);
  constexpr int64_t kUnit = 4096, kSpan = 12;  // (the decode stack's units: 6-48 KB spans, small tails)
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads)
#endif
  {
#if defined(_OPENMP)
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    uint64_t acc = 0, epoch = 0;
    int64_t at = 0;
    for (int64_t n : phases) {
      const int64_t units = (n + kUnit - 1) / kUnit;
      steal.start(t, nt, units, ++epoch);
      int64_t count = 0;
      for (int64_t u; (u = steal.next_span(t, nt, epoch, kSpan, 2, count)) >= 0;)
        acc ^= xor_range(p + at + u * kUnit, std::min(n, (u + count) * kUnit) - u * kUnit);
      at += n;
      meet.wait(nt);
    }
    part[t] = acc;
  }
  uint64_t acc = 0;
  for (uint64_t v : part) acc ^= v;
  int64_t out;
  std::memcpy(&out, &acc, 8);
  return out;
}

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("stream_read(Tensor buf) -> int");
  m.def("barrier_ns(int rounds) -> float", &barrier_ns);
  m.def("phased_read(Tensor buf, int[] phases) -> int");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("stream_read", &stream_read);
  m.impl("phased_read", &phased_read);
}
