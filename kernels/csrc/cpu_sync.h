// How the threads of one parallel region share a step's phases, for loops that meet many times a step
// (the decode stack, the MoE decode op) and the bandwidth benchmark's phase-by-phase read
// (cpu_membw.cpp): a phase's units handed out from per-thread ranges (Steal) and a spin barrier (Meet).
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace radixserve_lean {

// A phase's units of work (heads, groups of rows) handed out from per-thread ranges: each thread takes
// its own from the front, in order (one memory stream), then the others' from the back, so a thread
// that finishes early takes over the tail of a slower one instead of waiting at the barrier (a
// batch-1 step's barrier waits were ~9 % of it on a 2-core Zen 4: 15 QKV heads split 7 / 8, and the
// two cores' memory streams do not run at the same speed). A range is one 64-bit word: the phase's
// epoch, front and back; a word from another phase is never taken from.
class Steal {
 public:
  explicit Steal(int64_t threads) : slots_(threads) {}

  void start(int64_t tid, int64_t nt, int64_t units, uint64_t epoch) {
    slots_[tid].word.store(pack(epoch, units * tid / nt, units * (tid + 1) / nt), std::memory_order_release);
  }

  // This thread's next unit, or -1 when the phase has none left.
  int64_t next(int64_t tid, int64_t nt, uint64_t epoch) {
    int64_t u;
    if (take(tid, epoch, true, u)) return u;
    for (int64_t o = 1; o < nt; ++o)
      if (take((tid + o) % nt, epoch, false, u)) return u;
    return -1;
  }

  // As next, but up to `most` consecutive units of this thread's own range at once, leaving its last
  // `tail` units to be taken one by one (by it or by a thread that has finished): the first unit, or -1,
  // and their number in `count`. Big spans keep a thread's memory stream long; small ones at the end
  // keep the two threads' finishing times within a small unit of each other.
  int64_t next_span(int64_t tid, int64_t nt, uint64_t epoch, int64_t most, int64_t tail, int64_t& count) {
    uint64_t w = slots_[tid].word.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t f = (w >> 24) & 0xFFFFFF, b = w & 0xFFFFFF;
      if ((w >> 48) != (epoch & 0xFFFF) || f >= b) break;
      const int64_t k = std::max<int64_t>(1, std::min<int64_t>(most, static_cast<int64_t>(b - f) - tail));
      if (slots_[tid].word.compare_exchange_weak(w, pack(epoch, f + k, b), std::memory_order_acq_rel)) {
        count = k;
        return static_cast<int64_t>(f);
      }
    }
    int64_t u;
    for (int64_t o = 1; o < nt; ++o)
      if (take((tid + o) % nt, epoch, false, u)) {
        count = 1;
        return u;
      }
    return -1;
  }

 private:
  struct alignas(64) Slot {
    std::atomic<uint64_t> word{0};
  };
  std::vector<Slot> slots_;

  static uint64_t pack(uint64_t epoch, uint64_t front, uint64_t back) {
    return (epoch & 0xFFFF) << 48 | (front & 0xFFFFFF) << 24 | (back & 0xFFFFFF);
  }

  bool take(int64_t t, uint64_t epoch, bool front, int64_t& u) {
    uint64_t w = slots_[t].word.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t f = (w >> 24) & 0xFFFFFF, b = w & 0xFFFFFF;
      if ((w >> 48) != (epoch & 0xFFFF) || f >= b) return false;
      if (slots_[t].word.compare_exchange_weak(w, front ? pack(epoch, f + 1, b) : pack(epoch, f, b - 1),
                                               std::memory_order_acq_rel)) {
        u = static_cast<int64_t>(front ? f : b - 1);
        return true;
      }
    }
  }
};

// A barrier of a parallel region's threads: a count and a generation, each on its own line, and a
// spin on the generation (falling back to yielding, should the threads outnumber the cores). In place
// of `omp barrier` in the decode stack's step (180 barriers a step in the default model): batch-1 steps
// 2.6% faster on a 2-core Zen 4 whose two vCPUs ran on two CCDs, 1% on one (paired runs, 399 / 330).
class Meet {
 public:
  // (nt: the region's omp_get_num_threads())
  void wait(int64_t nt) {
    const uint64_t gen = gen_.v.load(std::memory_order_acquire);
    if (count_.v.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint64_t>(nt)) {
      count_.v.store(0, std::memory_order_relaxed);
      gen_.v.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int64_t spins = 0; gen_.v.load(std::memory_order_acquire) == gen;) {
      if (++spins < kSpins)
        pause();
      else
        std::this_thread::yield();
    }
  }

 private:
  static void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  static constexpr int64_t kSpins = 1 << 16;  // ~1-3 ms of pause instructions
  struct alignas(64) Word {
    std::atomic<uint64_t> v{0};
  };
  Word count_, gen_;
};

}  // namespace radixserve_lean
