// The simulator's dense matmul (Note [gemm kernel] in gemm.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace torch_popxl {

constexpr int64_t kGemmAten = 0;
constexpr int64_t kGemmOnednn = 1;

// a [..., K] @ b [K, N] (+ bias [N]) -> [..., N], through the kernel gemm_set_kernel chose.
at::Tensor gemm(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias);
// out = a [M, K] @ b [K, N], written into out [M, N] (the bits of gemm(a, b)).
void gemm_out_(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);
void gemm_set_kernel(int64_t kernel);
int64_t gemm_kernel();

}  // namespace torch_popxl
