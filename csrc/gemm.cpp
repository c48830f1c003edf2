// The simulator's dense matmul: ``a [..., K] @ b [K, N] (+ bias [N])`` through oneDNN or ATen.
//
// Note [gemm kernel]
// ~~~~~~~~~~~~~~~~~~
// A simulated step is mostly matmuls (the seed MNIST step 75 %, the small GPT-2 step 80 %), so
// which GEMM runs them sets the step time. ATen runs a CPU float32 matmul through MKL, and
// MKL takes its AVX-512 code only on Intel processors: on an AVX-512 AMD processor (Zen 4/5)
// it runs AVX2 code at half the width. oneDNN, which torch ships for its own fused CPU
// kernels (``mkldnn::_linear_pointwise``), picks its code by instruction set, and runs the
// same float32 matmuls 2-2.5x faster there. Both are exact float32 GEMMs; they add the K
// products in different orders, so results differ in the last bits.
//
// The kernel is a process-wide setting (torch_popxl/runtime/gemm.py chooses it, by a fixed
// rule: never by timing, so a program gives the same bits on every run and in every process
// of a launch). With oneDNN chosen, a call goes to oneDNN when it is a CPU float32 matmul of
// at least kMinProducts multiply-adds that autograd does not record; every other call (other
// devices or dtypes, tiny or empty matmuls, recorded calls) runs the ATen op it replaces, so
// the choice never changes what a call accepts or returns, only which kernel computes it.
//
// A transposed left operand without a bias (a weight gradient, x^T @ dy, folded over replicas
// and micro-batches) goes to oneDNN's matmul primitive, which reads any strides, rather than
// to its linear, which copies a non-contiguous input first: the same kernel and the same bits
// (tests/test_gemm.py), 10-20 % faster at the seed MLP's shapes.
//
// ``gemm_out_`` writes ``a @ b`` into a tensor the caller owns (a weight gradient straight into
// its accumulator: Note [weight gradients into their accumulators] in runtime/lower.py), with
// the bits ``gemm(a, b)`` gives: the same kernel, called with the caller's output instead of a
// fresh one (oneDNN's matmul and ATen's ``mm_out`` write any contiguous output). Where that
// kernel is oneDNN's linear, which makes its own output, the product is copied in.
#include "gemm.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

#include <atomic>

namespace at::native {
// result = beta * result + alpha * mat1 @ mat2 through oneDNN's matmul (ATen/native/mkldnn/
// Matmul.h, exported by libtorch_cpu but not among the installed headers).
TORCH_API void mkldnn_matmul(const Tensor& mat1, const Tensor& mat2, const Tensor& result,
                             float beta, float alpha);
}  // namespace at::native

namespace torch_popxl {
namespace {

std::atomic<int64_t> g_kernel{kGemmAten};

// Below this many multiply-adds oneDNN's per-call cost is more than its arithmetic saves.
constexpr int64_t kMinProducts = 32 * 1024;

bool use_onednn(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias) {
  if (g_kernel.load(std::memory_order_relaxed) != kGemmOnednn) return false;
  if (a.dim() < 2 || !a.device().is_cpu() || !b.device().is_cpu()) return false;
  if (a.scalar_type() != at::kFloat || b.scalar_type() != at::kFloat) return false;
  if (a.layout() != at::kStrided || b.layout() != at::kStrided) return false;
  const bool recorded = at::GradMode::is_enabled() &&
                        (a.requires_grad() || b.requires_grad() ||
                         (bias.has_value() && bias->requires_grad()));
  if (recorded) return false;
  const int64_t K = b.size(0), N = b.size(1);
  if (bias.has_value() && (!bias->device().is_cpu() || bias->scalar_type() != at::kFloat ||
                           bias->dim() != 1 || bias->size(0) != N ||
                           bias->layout() != at::kStrided)) {
    return false;  // oneDNN takes a full [N] bias; a broadcast one runs ATen's kernel
  }
  const int64_t rows = K == 0 ? 0 : a.numel() / K;
  return rows > 0 && K > 0 && N > 0 && rows * K * N >= kMinProducts;
}

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                            c10::string_view, c10::List<c10::optional<at::Scalar>>,
                            c10::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::nullopt);
}

}  // namespace

void gemm_set_kernel(int64_t kernel) {
  TORCH_CHECK_VALUE(kernel == kGemmAten || kernel == kGemmOnednn,
                    "gemm_set_kernel: expected ", kGemmAten, " (ATen) or ", kGemmOnednn,
                    " (oneDNN), got ", kernel, ".");
  g_kernel.store(kernel, std::memory_order_relaxed);
}

int64_t gemm_kernel() { return g_kernel.load(std::memory_order_relaxed); }

at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK_VALUE(a.dim() >= 1 && b.dim() == 2, "gemm: expected a [..., K] and b [K, N], got "
                    "shapes ", a.sizes(), " and ", b.sizes(), ".");
  TORCH_CHECK_VALUE(a.size(-1) == b.size(0), "gemm: a's last dim (", a.size(-1),
                    ") must equal b's first (", b.size(0), "); got shapes ", a.sizes(), " and ",
                    b.sizes(), ".");
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() <= 1 && (bias->dim() == 0 || bias->size(0) == b.size(1) ||
                                           bias->size(0) == 1),
                      "gemm: bias must be a scalar or [N] (N = ", b.size(1), "), got shape ",
                      bias->sizes(), ".");
  }
  if (use_onednn(a, b, bias)) {
    if (a.dim() == 2 && !bias.has_value() && !a.is_contiguous() && a.t().is_contiguous()) {
      at::Tensor out = at::empty({a.size(0), b.size(1)}, a.options());
      at::native::mkldnn_matmul(a, b, out, 0.0f, 1.0f);
      return out;
    }
    return onednn_linear(a, b.t(), bias);
  }
  if (a.dim() == 2) {
    return bias.has_value() ? at::addmm(*bias, a, b) : at::mm(a, b);
  }
  at::Tensor out = at::matmul(a, b);
  return bias.has_value() ? out.add_(*bias) : out;
}

void gemm_out_(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0),
                    "gemm_out_: expected a [M, K] and b [K, N], got shapes ", a.sizes(), " and ",
                    b.sizes(), ".");
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == a.size(0) && out.size(1) == b.size(1) &&
                        out.scalar_type() == a.scalar_type() && out.device() == a.device(),
                    "gemm_out_: out must be [", a.size(0), ", ", b.size(1), "] ",
                    a.scalar_type(), " on ", a.device(), " (a @ b), got ", out.sizes(), " ",
                    out.scalar_type(), " on ", out.device(), ".");
  const bool plain_out = out.is_contiguous() && out.layout() == at::kStrided;
  if (plain_out && use_onednn(a, b, c10::nullopt)) {
    if (!a.is_contiguous() && a.t().is_contiguous()) {  // gemm's oneDNN matmul path
      at::native::mkldnn_matmul(a, b, out, 0.0f, 1.0f);
      return;
    }
  } else if (plain_out) {
    at::Tensor target = out;
    at::mm_out(target, a, b);  // gemm's ATen path for 2-D operands
    return;
  }
  out.copy_(gemm(a, b, c10::nullopt));
}

}  // namespace torch_popxl
