// The single-tensor SGD update in one pass over memory. Note [one-pass SGD update] in
// torch_popxl/opdefs/sgd.py says when the compiled step calls it and what it replaces.
//
// torch's single-tensor SGD (the CPU default) runs up to four ATen kernels per parameter, and
// the compiled step around it more (the gradient's rescaling, the p.grad copy, the first-step
// select). This kernel reads the gradient, parameter and momentum buffer once and writes the
// parameter, the buffer and (when kept) p.grad once, computing every element as those ATen
// kernels round it on a CPU whose kernels run with AVX2 or AVX-512, float32 throughout. In
// ATen, ``add(a, b, alpha)`` is ``vec::fmadd(b, alpha, a)`` in its vector body and
// ``a + alpha * b`` in its scalar tail, which the compiler contracts into the same fused
// multiply-add (one rounding); ``mul`` by a number is one rounding:
//
//   g = g * f, for each factor f       (the loss-count / loss-scale rescaling, one rounding each)
//   p.grad = g                          (when kept: before maximize and weight decay)
//   g = -g                              (maximize)
//   g = fma(wd, p, g)                   (grad.add(param, alpha=weight_decay))
//   b = first step ? g : fma(1 - dampening, g, b * momentum)
//                                       (buf.mul_(momentum).add_(grad, alpha=1 - dampening))
//   g = nesterov ? fma(momentum, b, g) : b   (grad.add(buf, alpha=momentum))
//   p = fma(-lr, g, p)                  (param.add_(grad, alpha=-lr))
//
// The scalars are float32 as ATen's kernels take them: lr, weight decay, momentum from the
// group's float64 hyperparameter vector, cast once; 1 - dampening computed in float64, then
// cast (as Python computes it before handing it to add_). Every step is an IEEE-754 single
// rounding whatever the instruction width, so the AVX-512, AVX2 and scalar paths give the
// same bits, and the elements are independent, so neither the thread split nor the vector
// tails change any bit. The file writes every fused multiply-add explicitly and never adds a
// product, so no compiler contraction can change a rounding. The vector bodies load and store
// whole vectors (masked loads and stores in the body ran at half speed on an AMD EPYC); only
// the last partial vector is masked.
#include "cpu.h"
#include "kernels.h"

#include <ATen/TensorIterator.h>
#include <c10/util/Exception.h>

#include <climits>
#include <cmath>
#include <cstdint>

#ifdef TORCH_POPXL_X86
#include <immintrin.h>
#endif

namespace torch_popxl {
namespace {

struct SgdScalars {
  float neg_lr, wd, momentum, one_minus_dampening;
  const float* factors;
  int64_t num_factors;
  bool use_wd, use_momentum, first, nesterov, maximize;
};

struct SgdPointers {
  float* p;
  float* buf;       // null without momentum
  float* grad_out;  // null when p.grad is not kept
  const float* g;
};

inline void sgd_scalar(const SgdScalars& s, const SgdPointers& x, int64_t i) {
  float g = x.g[i];
  for (int64_t k = 0; k < s.num_factors; ++k) g = g * s.factors[k];
  if (x.grad_out != nullptr) x.grad_out[i] = g;
  if (s.maximize) g = -g;
  if (s.use_wd) g = std::fma(s.wd, x.p[i], g);
  if (s.use_momentum) {
    const float b = s.first ? g : std::fma(s.one_minus_dampening, g, x.buf[i] * s.momentum);
    x.buf[i] = b;
    g = s.nesterov ? std::fma(s.momentum, b, g) : b;
  }
  x.p[i] = std::fma(s.neg_lr, g, x.p[i]);
}

void sgd_generic(const SgdScalars& s, const SgdPointers& x, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) sgd_scalar(s, x, i);
}

#ifdef TORCH_POPXL_X86

__attribute__((target("avx2,fma"))) void sgd_avx2(const SgdScalars& s, const SgdPointers& x,
                                                   int64_t begin, int64_t end) {
  const __m256 neg_lr = _mm256_set1_ps(s.neg_lr), wd = _mm256_set1_ps(s.wd);
  const __m256 mom = _mm256_set1_ps(s.momentum), omd = _mm256_set1_ps(s.one_minus_dampening);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g = _mm256_loadu_ps(x.g + i);
    for (int64_t k = 0; k < s.num_factors; ++k) g = _mm256_mul_ps(g, _mm256_set1_ps(s.factors[k]));
    if (x.grad_out != nullptr) _mm256_storeu_ps(x.grad_out + i, g);
    if (s.maximize) g = _mm256_xor_ps(g, sign);
    __m256 p = _mm256_loadu_ps(x.p + i);
    if (s.use_wd) g = _mm256_fmadd_ps(wd, p, g);
    if (s.use_momentum) {
      const __m256 b =
          s.first ? g : _mm256_fmadd_ps(omd, g, _mm256_mul_ps(_mm256_loadu_ps(x.buf + i), mom));
      _mm256_storeu_ps(x.buf + i, b);
      g = s.nesterov ? _mm256_fmadd_ps(mom, b, g) : b;
    }
    _mm256_storeu_ps(x.p + i, _mm256_fmadd_ps(neg_lr, g, p));
  }
  for (; i < end; ++i) sgd_scalar(s, x, i);  // std::fma is one vfmadd here
}

// The tail runs the same instructions on masked lanes (the masked-off lanes are never stored).
template <bool kTail>
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const float* a,
                                                                        __mmask16 m) {
  return kTail ? _mm512_maskz_loadu_ps(m, a) : _mm512_loadu_ps(a);
}

template <bool kTail>
__attribute__((target("avx512f"), always_inline)) inline void store16(float* a, __mmask16 m,
                                                                       __m512 v) {
  if (kTail) {
    _mm512_mask_storeu_ps(a, m, v);
  } else {
    _mm512_storeu_ps(a, v);
  }
}

template <bool kTail>
__attribute__((target("avx512f"), always_inline)) inline void sgd_avx512_step(
    const SgdScalars& s, const SgdPointers& x, int64_t i, __mmask16 m) {
  const __m512 neg_lr = _mm512_set1_ps(s.neg_lr), wd = _mm512_set1_ps(s.wd);
  const __m512 mom = _mm512_set1_ps(s.momentum), omd = _mm512_set1_ps(s.one_minus_dampening);
  const __m512i sign = _mm512_set1_epi32(INT32_MIN);  // negation flips the sign bit only
  __m512 g = load16<kTail>(x.g + i, m);
  for (int64_t k = 0; k < s.num_factors; ++k) g = _mm512_mul_ps(g, _mm512_set1_ps(s.factors[k]));
  if (x.grad_out != nullptr) store16<kTail>(x.grad_out + i, m, g);
  if (s.maximize) g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign));
  const __m512 p = load16<kTail>(x.p + i, m);
  if (s.use_wd) g = _mm512_fmadd_ps(wd, p, g);
  if (s.use_momentum) {
    const __m512 b = s.first ? g : _mm512_fmadd_ps(omd, g, _mm512_mul_ps(load16<kTail>(x.buf + i, m), mom));
    store16<kTail>(x.buf + i, m, b);
    g = s.nesterov ? _mm512_fmadd_ps(mom, b, g) : b;
  }
  store16<kTail>(x.p + i, m, _mm512_fmadd_ps(neg_lr, g, p));
}

__attribute__((target("avx512f"))) void sgd_avx512(const SgdScalars& s, const SgdPointers& x,
                                                    int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) sgd_avx512_step<false>(s, x, i, 0xFFFF);
  if (i < end) sgd_avx512_step<true>(s, x, i, __mmask16((1u << (end - i)) - 1u));
}

#endif

using SgdPass = void (*)(const SgdScalars&, const SgdPointers&, int64_t, int64_t);

SgdPass pick_pass() {
#ifdef TORCH_POPXL_X86
  if (cpu_has_avx512f()) return sgd_avx512;
  if (cpu_has_avx2_fma()) return sgd_avx2;
#endif
  return sgd_generic;
}

void check_args(const at::Tensor& param, const std::optional<at::Tensor>& buf,
                const std::optional<at::Tensor>& grad_out, const at::Tensor& grad,
                const at::Tensor& hyper, const at::Tensor& step, const at::Tensor& factors) {
  TORCH_CHECK(param.scalar_type() == at::kFloat && param.device().is_cpu(),
              "sgd_update_: the one-pass kernel takes float32 CPU parameters; got ",
              param.scalar_type(), " on ", param.device(),
              " (other dtypes and devices run the per-op update)");
  for (const auto* t : {&grad, buf ? &*buf : nullptr, grad_out ? &*grad_out : nullptr}) {
    if (t == nullptr) continue;
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() &&
                    t->sizes() == param.sizes(),
                "sgd_update_: the gradient, momentum buffer and p.grad must be float32 CPU "
                "tensors of the parameter's shape ",
                param.sizes(), "; got ", t->scalar_type(), " of shape ", t->sizes());
  }
  TORCH_CHECK(hyper.scalar_type() == at::kDouble && hyper.numel() >= 4,
              "sgd_update_: hyper must be the group's float64 hyperparameters (lr, weight decay, "
              "momentum, dampening); got ",
              hyper.scalar_type(), " with ", hyper.numel(), " elements");
  TORCH_CHECK(step.numel() == 1, "sgd_update_: step must hold one number; got ", step.numel());
  TORCH_CHECK(factors.scalar_type() == at::kFloat && factors.dim() == 1,
              "sgd_update_: factors must be a 1-D float32 tensor; got ", factors.scalar_type(),
              " of shape ", factors.sizes());
}

}  // namespace

void sgd_update_(const at::Tensor& param, const std::optional<at::Tensor>& momentum_buffer,
                 const std::optional<at::Tensor>& grad_out, const at::Tensor& grad,
                 const at::Tensor& hyper, const at::Tensor& step, const at::Tensor& factors,
                 bool weight_decay, bool nesterov, bool maximize) {
  check_args(param, momentum_buffer, grad_out, grad, hyper, step, factors);
  const at::Tensor h = hyper.to(at::kDouble).contiguous().cpu();
  const double* hv = h.data_ptr<double>();
  const at::Tensor f = factors.contiguous().cpu();
  SgdScalars s{};
  s.neg_lr = -static_cast<float>(hv[0]);
  s.wd = static_cast<float>(hv[1]);
  s.momentum = static_cast<float>(hv[2]);
  s.one_minus_dampening = static_cast<float>(1.0 - hv[3]);
  s.factors = f.data_ptr<float>();
  s.num_factors = f.numel();
  s.use_wd = weight_decay;
  s.use_momentum = momentum_buffer.has_value();
  // torch makes the buffer from the first step's gradient (no dampening on it)
  s.first = step.item<double>() == 0.0;
  s.nesterov = nesterov;
  s.maximize = maximize;
  // The elements in TensorIterator's order, split over torch's intra-op threads by its
  // for_each (compiled into libtorch with torch's OpenMP: this extension's at::parallel_for,
  // built without -fopenmp, would run on one thread). The tensors it writes are outputs that
  // the loop also reads.
  at::TensorIteratorConfig config;
  config.set_check_mem_overlap(false).check_all_same_dtype(true).resize_outputs(false);
  config.add_output(param);
  if (momentum_buffer) config.add_output(*momentum_buffer);
  if (grad_out) config.add_output(*grad_out);
  config.add_const_input(grad);
  at::TensorIterator iter = config.build();
  const int b = momentum_buffer ? 1 : -1;
  const int o = grad_out ? 1 + (b > 0) : -1;
  const int gi = iter.ntensors() - 1;
  static const SgdPass pass = pick_pass();
  // 2^15 elements (128 KiB per array) per task at least: the thread hand-off is amortised.
  iter.for_each(
      [&](char** data, const int64_t* strides, int64_t n) {
        SgdPointers x{reinterpret_cast<float*>(data[0]),
                      b > 0 ? reinterpret_cast<float*>(data[b]) : nullptr,
                      o > 0 ? reinterpret_cast<float*>(data[o]) : nullptr,
                      reinterpret_cast<const float*>(data[gi])};
        bool contiguous = true;
        for (int k = 0; k < iter.ntensors(); ++k) contiguous &= strides[k] == sizeof(float);
        if (contiguous) {
          pass(s, x, 0, n);
          return;
        }
        for (int64_t i = 0; i < n; ++i) {  // strided: one element at a time
          SgdPointers e{reinterpret_cast<float*>(data[0] + i * strides[0]),
                        b > 0 ? reinterpret_cast<float*>(data[b] + i * strides[b]) : nullptr,
                        o > 0 ? reinterpret_cast<float*>(data[o] + i * strides[o]) : nullptr,
                        reinterpret_cast<const float*>(data[gi] + i * strides[gi])};
          sgd_scalar(s, e, 0);
        }
      },
      32768);
}

}  // namespace torch_popxl
