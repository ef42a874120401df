// Helpers shared by the CPU kernels: float conversion and an exp the compiler vectorizes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace radixserve_cpu {

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// exp(x) on [-87, 88] (clamped outside; -inf lands at exp(-87) ~ 1.6e-38, i.e. ~0), written so
// the compiler vectorizes it: 2^n * p(r) with n = round(x / ln2) and a degree-6 polynomial on
// |r| <= ln2/2 (relative error ~2e-7).
inline float vexp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace radixserve_cpu
