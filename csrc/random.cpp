// Note [counter-based bernoulli]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Dropout's mask is ``bernoulli_(p)`` over the activations: ATen's CPU kernel draws each
// element through its generator, ~5 ns per element here, which made dropout a tenth of a
// small GPT-2 step. ``bernoulli_p_`` draws one 64-bit seed from the same default CPU generator
// (so ``torch.manual_seed`` still makes a run repeatable) and gives element i the bits of
// SplitMix64 at counter ``seed + (i / 2) * golden`` (two 32-bit halves, one per element): a
// counter-based stream, so any chunk of elements is computed independently, in parallel, and
// the result does not depend on the thread count. Element i is 1 where its 32 bits are below
// ``p * 2^32``, else 0: P(1) = p to within 2^-32. The values differ from ATen's; the
// distribution is the same (tests/test_random_replicas.py checks rates and independence).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "kernels.h"
#include "parallel.h"

namespace torch_popxl {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

uint64_t draw_seed() {
  auto gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      std::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->random64();
}

// Elements 2k and 2k + 1 for k in [begin, end): one draw per pair.
template <typename scalar_t>
inline void fill_pairs(
    scalar_t* out, int64_t begin, int64_t end, uint64_t seed, uint64_t threshold) {
  const auto one = static_cast<scalar_t>(1), zero = static_cast<scalar_t>(0);
  for (int64_t k = begin; k < end; ++k) {
    const uint64_t bits = splitmix64(seed + static_cast<uint64_t>(k) * kGolden);
    out[2 * k] = (bits & 0xFFFFFFFFULL) < threshold ? one : zero;
    out[2 * k + 1] = (bits >> 32) < threshold ? one : zero;
  }
}

// Note [vectorised mask draws]
//     SplitMix64 is two 64-bit multiplies per pair: the baseline x86-64 code the extension
//     is built for has no vector form of them, so the compiler leaves the loop scalar
//     (~5 ns a pair). AVX-512 (vpmullq) runs it about twenty times faster. The float and
//     double loops are compiled for several targets and the loader picks the best the CPU
//     has (GCC's target clones); the values do not depend on the target.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define TORCH_POPXL_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define TORCH_POPXL_TARGET_CLONES
#endif

TORCH_POPXL_TARGET_CLONES void fill_pairs_float(
    float* out, int64_t begin, int64_t end, uint64_t seed, uint64_t threshold) {
  fill_pairs(out, begin, end, seed, threshold);
}

TORCH_POPXL_TARGET_CLONES void fill_pairs_double(
    double* out, int64_t begin, int64_t end, uint64_t seed, uint64_t threshold) {
  fill_pairs(out, begin, end, seed, threshold);
}

template <typename scalar_t>
void fill_mask(scalar_t* out, int64_t n, uint64_t seed, uint64_t threshold) {
  // element pairs share one 64-bit draw: the pairs in parallel chunks, an odd last one after;
  // a chunk of 2^17 pairs takes ~30 us vectorised, less would cost more in waking threads
  // Note [threads in the extension]
  parallel_range(n / 2, int64_t{1} << 17, [&](int64_t begin, int64_t end) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      fill_pairs_float(out, begin, end, seed, threshold);
    } else if constexpr (std::is_same_v<scalar_t, double>) {
      fill_pairs_double(out, begin, end, seed, threshold);
    } else {
      fill_pairs(out, begin, end, seed, threshold);
    }
  });
  if (n % 2 == 1) {
    const uint64_t bits = splitmix64(seed + static_cast<uint64_t>(n / 2) * kGolden);
    out[n - 1] = (bits & 0xFFFFFFFFULL) < threshold ? static_cast<scalar_t>(1)
                                                     : static_cast<scalar_t>(0);
  }
}

}  // namespace

at::Tensor& bernoulli_p_(at::Tensor& self, double p) {
  TORCH_CHECK(
      p >= 0.0 && p <= 1.0, "bernoulli_p_: expected 0 <= p <= 1, got p=", p,
      " (the probability of drawing a 1).");
  TORCH_CHECK(
      self.device().is_cpu(), "bernoulli_p_: the counter-based kernel runs on the CPU; got ",
      self.device(), " (other devices call bernoulli_).");
  TORCH_CHECK(
      at::isFloatingType(self.scalar_type()),
      "bernoulli_p_: expected a floating-point tensor, got ", self.scalar_type());
  // p * 2^32 rounded down; p = 1 keeps every element (the 33-bit threshold beats every draw)
  const uint64_t threshold = static_cast<uint64_t>(std::ldexp(p, 32));
  const uint64_t seed = draw_seed();
  at::Tensor out = self.is_contiguous() ? self : at::empty_like(self, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "bernoulli_p_", [&] {
    fill_mask<scalar_t>(out.data_ptr<scalar_t>(), out.numel(), seed, threshold);
  });
  if (!out.is_same(self)) {
    self.copy_(out);
  }
  return self;
}

at::Tensor& bernoulli_p_fallback(at::Tensor& self, double p) {
  return self.bernoulli_(p);
}

}  // namespace torch_popxl
