// torch's single-tensor Adam step (the default on CPU) in three passes over each parameter.
//
// Note [Adam chain in three passes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch.optim.Adam without ``foreach``/``fused`` (the CPU default) updates each parameter with
// a chain of in-place ops, each a full pass over parameter-sized tensors:
//
//   exp_avg.lerp_(grad, 1 - beta1)
//   exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
//   denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-step_size)
//
// Seven passes over ~4 tensors each make the update of a ~1M-parameter model cost about a
// quarter of its matmuls. ``adam_chain_`` computes the same chain in three passes, every
// intermediate rounded to float32 exactly where the chain rounds it: the two moments
// together, torch's own ``sqrt`` (on CPU it runs MKL's vector sqrt, which is not the
// correctly rounded one, so only torch's op gives its bits), then the denominator and the
// parameter together. The arithmetic is torch's CPU kernels' own, checked bit for bit against
// eager torch's Adam (tests/test_adam_chain.py): lerp with a weight below 0.5 is
// ``fma(w, end - self, self)`` and otherwise ``fma(w - 1, end - self, end)``; addcmul is
// ``fma(value * t1, t2, self)``; the division by the bias correction, the add of eps and
// addcdiv's ``self + value * t1 / t2`` round once per op. (Those kernels contract the
// multiply-adds into fused multiply-adds in their vectorised body and their scalar tail alike,
// so the result does not depend on where an element falls in its tensor.) This file is
// compiled without contraction, so each intrinsic below is one rounding.
//
// The compiled step hands it the replica-summed gradient accumulator itself: ``factors`` (the
// loss-count and loss-scale rescalings, the clip coefficient) multiply the gradient in turn, one
// rounding each as the separate multiplies round, and ``grad_outs`` (``p.grad``, when kept)
// receive the product, all in the first pass, which reads the gradient anyway (the rescale and
// the copy were two more passes and a temporary, Note [one-pass SGD update] does the same).
//
// The three-pass kernel runs on contiguous float32 CPU tensors of one size on a processor with
// AVX-512; anything else runs the chain itself through ATen's ops (the same numbers).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <optional>
#include <vector>

#include "cpu.h"
#include "kernels.h"
#include "parallel.h"

#ifdef TORCH_POPXL_X86
#include <immintrin.h>
#endif

namespace torch_popxl {
namespace {

struct AdamScalars {
  const float* factors;  // the gradient's multipliers, applied in turn
  int64_t num_factors;
  float w;      // 1 - beta1 (lerp's weight)
  float b2;     // beta2
  float omb2;   // 1 - beta2
  float bc2;    // sqrt(1 - beta2 ** step)
  float eps;
  float neg_step;  // -lr / (1 - beta1 ** step)
};

#ifdef TORCH_POPXL_X86
__mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
}

// grad = grad * f for each factor f, grad_out = grad (unless null);
// exp_avg.lerp_(grad, w); exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
__attribute__((target("avx512f"))) void moments_avx512(const float* g, float* grad_out,
                                                       float* m, float* v, int64_t begin,
                                                       int64_t end, const AdamScalars& s) {
  const bool small = std::abs(s.w) < 0.5f;
  const __m512 coeff = _mm512_set1_ps(small ? s.w : s.w - 1.0f);
  const __m512 b2 = _mm512_set1_ps(s.b2), omb2 = _mm512_set1_ps(s.omb2);
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 k = tail_mask(end - i);
    __m512 gi = _mm512_maskz_loadu_ps(k, g + i);
    for (int64_t f = 0; f < s.num_factors; ++f) gi = _mm512_mul_ps(gi, _mm512_set1_ps(s.factors[f]));
    if (grad_out != nullptr) _mm512_mask_storeu_ps(grad_out + i, k, gi);
    const __m512 mi = _mm512_maskz_loadu_ps(k, m + i);
    const __m512 vi = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, v + i), b2);
    _mm512_mask_storeu_ps(m + i, k, _mm512_fmadd_ps(coeff, _mm512_sub_ps(gi, mi), small ? mi : gi));
    _mm512_mask_storeu_ps(v + i, k, _mm512_fmadd_ps(_mm512_mul_ps(omb2, gi), gi, vi));
  }
}

// denom = (root / bias_correction2_sqrt).add_(eps); param.addcdiv_(exp_avg, denom, -step_size)
__attribute__((target("avx512f"))) void params_avx512(float* p, const float* m,
                                                      const float* root, int64_t begin,
                                                      int64_t end, const AdamScalars& s) {
  const __m512 bc2 = _mm512_set1_ps(s.bc2), eps = _mm512_set1_ps(s.eps);
  const __m512 ns = _mm512_set1_ps(s.neg_step);
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 k = tail_mask(end - i);
    const __m512 denom =
        _mm512_add_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(k, root + i), bc2), eps);
    const __m512 mi = _mm512_maskz_loadu_ps(k, m + i);
    const __m512 pi = _mm512_maskz_loadu_ps(k, p + i);
    _mm512_mask_storeu_ps(p + i, k, _mm512_add_ps(pi, _mm512_div_ps(_mm512_mul_ps(ns, mi), denom)));
  }
}
#endif

float scalar_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.numel() == 1, "adam_chain_: ", name,
                    " must be a one-element tensor (the value every element uses), got shape ",
                    t.sizes(), ".");
  return t.item<float>();
}

bool one_pass_ok(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m,
                 const at::Tensor& v, const at::Tensor* grad_out) {
  std::vector<const at::Tensor*> all = {&p, &g, &m, &v};
  if (grad_out != nullptr) all.push_back(grad_out);
  for (const at::Tensor* t : all) {
    if (!t->device().is_cpu() || t->scalar_type() != at::kFloat || !t->is_contiguous() ||
        t->layout() != at::kStrided || t->sizes() != p.sizes()) {
      return false;
    }
  }
  // none may overlap (the chain reads the gradient after writing the state)
  for (size_t a = 0; a < all.size(); ++a)
    for (size_t b = a + 1; b < all.size(); ++b)
      if (p.numel() > 0 && all[a]->const_data_ptr() == all[b]->const_data_ptr()) return false;
  return cpu_has_avx512f();
}

void check_factors(const at::Tensor& factors) {
  TORCH_CHECK_VALUE(factors.scalar_type() == at::kFloat && factors.dim() == 1 &&
                        factors.device().is_cpu(),
                    "adam_chain_: factors must be a 1-D float32 CPU tensor (the gradient's "
                    "multipliers, applied in turn), got ",
                    factors.scalar_type(), " of shape ", factors.sizes(), " on ",
                    factors.device(), ".");
}

}  // namespace

void adam_chain_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, const at::Tensor& one_minus_beta1,
                 const at::Tensor& beta2, const at::Tensor& one_minus_beta2,
                 const at::Tensor& step_size, const at::Tensor& bias_correction2_sqrt,
                 const at::Tensor& eps, std::optional<at::TensorList> grad_outs_,
                 const std::optional<at::Tensor>& factors) {
  const size_t n = params.size();
  const at::TensorList grad_outs = grad_outs_.value_or(at::TensorList());
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
                    "adam_chain_: expected as many gradients, exp_avgs and exp_avg_sqs as "
                    "params (", n, "), got ", grads.size(), ", ", exp_avgs.size(), " and ",
                    exp_avg_sqs.size(), ".");
  TORCH_CHECK_VALUE(grad_outs.empty() || grad_outs.size() == n,
                    "adam_chain_: grad_outs must be empty (p.grad not kept) or hold one tensor "
                    "per param (", n, "), got ", grad_outs.size(), ".");
  for (size_t k = 0; k < grad_outs.size(); ++k) {
    TORCH_CHECK_VALUE(grad_outs[k].sizes() == grads[k].sizes() &&
                          grad_outs[k].scalar_type() == grads[k].scalar_type(),
                      "adam_chain_: grad_outs[", k, "] must have its gradient's shape ",
                      grads[k].sizes(), " and dtype ", grads[k].scalar_type(), ", got ",
                      grad_outs[k].sizes(), " and ", grad_outs[k].scalar_type(), ".");
  }
  at::Tensor f = factors ? *factors : at::empty({0}, at::kFloat);
  check_factors(f);
  f = f.contiguous();
  const AdamScalars s{f.const_data_ptr<float>(), f.numel(),
                      scalar_of(one_minus_beta1, "one_minus_beta1"), scalar_of(beta2, "beta2"),
                      scalar_of(one_minus_beta2, "one_minus_beta2"),
                      scalar_of(bias_correction2_sqrt, "bias_correction2_sqrt"),
                      scalar_of(eps, "eps"), -scalar_of(step_size, "step_size")};
  for (size_t k = 0; k < n; ++k) {
    const at::Tensor &p = params[k], &g = grads[k], &m = exp_avgs[k], &v = exp_avg_sqs[k];
    const at::Tensor* out = grad_outs.empty() ? nullptr : &grad_outs[k];
#ifdef TORCH_POPXL_X86
    if (one_pass_ok(p, g, m, v, out)) {
      float* pp = p.data_ptr<float>();
      const float* gp = g.const_data_ptr<float>();
      float* op = out != nullptr ? out->data_ptr<float>() : nullptr;
      float* mp = m.data_ptr<float>();
      float* vp = v.data_ptr<float>();
      const int64_t numel = p.numel();
      // Note [threads in the extension]
      parallel_range(numel, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
        moments_avx512(gp, op, mp, vp, begin, end, s);
      });
      const at::Tensor root = v.sqrt();  // torch's own sqrt (see the note)
      const float* rp = root.const_data_ptr<float>();
      parallel_range(numel, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
        params_avx512(pp, mp, rp, begin, end, s);
      });
      continue;
    }
#endif
    // the rescale, the copy into p.grad and the chain itself (what eager torch runs)
    at::Tensor grad = g;
    for (int64_t i = 0; i < f.numel(); ++i) grad = grad * f[i];
    if (out != nullptr) out->copy_(grad);
    m.lerp_(grad, s.w);
    v.mul_(s.b2).addcmul_(grad, grad, s.omb2);
    at::Tensor denom = v.sqrt();
    denom.div_(s.bc2).add_(s.eps);
    p.addcdiv_(m, denom, s.neg_step);
  }
}

}  // namespace torch_popxl
