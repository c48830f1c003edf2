// Declarations of the kernels behind torch.ops.torch_popxl.*; csrc/registration.cpp is the
// one place that registers them.
//
// Stacked layout: dim 0 of every tensor argument is the replica dim, of size R (the number of
// simulated replicas). A grouping is (group_size G, stride S) as in popxl.md §2.1.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "traffic.h"

namespace torch_popxl {

at::Tensor all_reduce_stacked(
    const at::Tensor& x, c10::string_view op, int64_t group_size, int64_t stride);
at::Tensor all_gather_stacked(const at::Tensor& x, int64_t group_size, int64_t stride);
at::Tensor reduce_scatter_stacked(
    const at::Tensor& x, c10::string_view op, int64_t group_size, int64_t stride);
at::Tensor take_own_stacked(const at::Tensor& x, int64_t group_size, int64_t stride);

// Full-group (G = R) collectives with an unbatched result, and the fused matmul + all-reduce.
at::Tensor all_reduce_full(const at::Tensor& x, c10::string_view op);
at::Tensor all_gather_full(const at::Tensor& x);
at::Tensor mm_all_reduce_stacked(const at::Tensor& a, const at::Tensor& b, c10::string_view op);

at::Tensor remote_load_stacked(
    const at::Tensor& buffer, const at::Tensor& offsets, int64_t buffer_id);
// Every replica's slot ``offset`` as a view of the stacked buffer ([R, *slot_shape]), counted
// as a remote load: for a fast-executor load whose value goes back to the same slot
// (Note [remote slot views] in runtime/lower.py). A store of that very view moves nothing.
at::Tensor remote_slot_view(const at::Tensor& buffer, int64_t offset, int64_t buffer_id);
void remote_store_stacked_(
    const at::Tensor& buffer, const at::Tensor& offsets, const at::Tensor& value,
    int64_t buffer_id);

// Note [counter-based bernoulli] (random.cpp): ``self`` filled with 1 with probability ``p``,
// else 0, from one seed of the default CPU generator; other devices call ``bernoulli_``.
at::Tensor& bernoulli_p_(at::Tensor& self, double p);
at::Tensor& bernoulli_p_fallback(at::Tensor& self, double p);

// Note [one-pass SGD update] (sgd.cpp, torch_popxl/opdefs/sgd.py): torch's single-tensor SGD
// step on one float32 CPU parameter in one pass, rounded as eager's ATen kernels round it.
void sgd_update_(const at::Tensor& param, const std::optional<at::Tensor>& momentum_buffer,
                 const std::optional<at::Tensor>& grad_out, const at::Tensor& grad,
                 const at::Tensor& hyper, const at::Tensor& step, const at::Tensor& factors,
                 bool weight_decay, bool nesterov, bool maximize);
// Note [Adam chain in three passes] (adam.cpp): torch's single-tensor Adam step, per parameter.
void adam_chain_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, const at::Tensor& one_minus_beta1,
                 const at::Tensor& beta2, const at::Tensor& one_minus_beta2,
                 const at::Tensor& step_size, const at::Tensor& bias_correction2_sqrt,
                 const at::Tensor& eps, std::optional<at::TensorList> grad_outs,
                 const std::optional<at::Tensor>& factors);

}  // namespace torch_popxl
