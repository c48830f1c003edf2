// Operator schemas and kernel registrations for the torch_popxl namespace: the ONE place
// where C++ ops are registered. Kernel files (collectives.cpp, fused.cpp, remote.cpp,
// traffic.cpp, step_cache.cpp, gemm.cpp, random.cpp, sgd.cpp, adam.cpp) only define functions,
// declared in kernels.h / traffic.h / step_cache.h / gemm.h; adding an op means one m.def below
// plus one line in register_kernels.
//
// Only the "stacked" kernels (replica dim first) live in C++. The per-replica ops that the IR
// records (torch_popxl::replicated_all_reduce, ...) are torch.library.custom_ops defined in
// the op's stanza, torch_popxl/opdefs/<op>.py; their vmap rules call these kernels. The stanza
// also holds the kernels' fake (shape) implementations and autograd formulas: each
// set_python_module below names the stanza of the ops defined after it, so the dispatcher
// knows where to find them.
#include <torch/library.h>

#include "gemm.h"
#include "kernels.h"
#include "step_cache.h"

TORCH_LIBRARY(torch_popxl, m) {
  // Stacked collectives (collectives.cpp) and their full-group forms (fused.cpp).
  m.set_python_module("torch_popxl.opdefs.all_reduce");
  m.def("all_reduce_stacked(Tensor x, str op, int group_size, int stride) -> Tensor");
  m.def("all_reduce_full(Tensor x, str op) -> Tensor");
  m.set_python_module("torch_popxl.opdefs.all_gather");
  m.def("all_gather_stacked(Tensor x, int group_size, int stride) -> Tensor");
  m.def("all_gather_full(Tensor x) -> Tensor");
  m.set_python_module("torch_popxl.opdefs.reduce_scatter");
  m.def("reduce_scatter_stacked(Tensor x, str op, int group_size, int stride) -> Tensor");
  m.set_python_module("torch_popxl.opdefs.take_own");
  m.def("take_own_stacked(Tensor x, int group_size, int stride) -> Tensor");
  // The fused matmul + all-reduce (fused.cpp).
  m.set_python_module("torch_popxl.opdefs.fused");
  m.def("mm_all_reduce_stacked(Tensor a, Tensor b, str op) -> Tensor");
  // The dense matmul and its kernel setting (gemm.cpp, Note [gemm kernel]).
  m.set_python_module("torch_popxl.runtime.gemm");
  m.def("gemm(Tensor a, Tensor b, Tensor? bias=None) -> Tensor");
  m.def("gemm_out_(Tensor(a!) out, Tensor a, Tensor b) -> ()");
  m.def("gemm_set_kernel(int kernel) -> ()", TORCH_FN(torch_popxl::gemm_set_kernel));
  m.def("gemm_kernel() -> int", TORCH_FN(torch_popxl::gemm_kernel));
  // Remote buffers (remote.cpp).
  m.set_python_module("torch_popxl.opdefs.remote");
  m.def("remote_load_stacked(Tensor buffer, Tensor offsets, int buffer_id) -> Tensor");
  m.def("remote_slot_view(Tensor(a) buffer, int offset, int buffer_id) -> Tensor(a)");
  m.def(
      "remote_store_stacked_(Tensor(a!) buffer, Tensor offsets, Tensor value, int buffer_id)"
      " -> ()");
  // Dropout masks (random.cpp, Note [counter-based bernoulli]).
  m.set_python_module("torch_popxl.runtime.random");
  m.def("bernoulli_p_(Tensor(a!) self, float p) -> Tensor(a!)");
  // The one-pass SGD update (sgd.cpp, Note [one-pass SGD update]).
  m.set_python_module("torch_popxl.opdefs.sgd");
  m.def(
      "sgd_update_(Tensor(a!) param, Tensor(b!)? momentum_buffer, Tensor(c!)? grad_out, "
      "Tensor grad, Tensor hyper, Tensor step, Tensor factors, bool weight_decay, bool nesterov, "
      "bool maximize) -> ()");
  // torch's single-tensor Adam step (adam.cpp, Note [Adam chain in three passes]).
  m.set_python_module("torch_popxl.opdefs.scalar_tensor");
  m.def(
      "adam_chain_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs,"
      " Tensor(c!)[] exp_avg_sqs, Tensor one_minus_beta1, Tensor beta2, Tensor one_minus_beta2,"
      " Tensor step_size, Tensor bias_correction2_sqrt, Tensor eps, Tensor(d!)[]? grad_outs=None,"
      " Tensor? factors=None) -> ()");
  // Traffic counters (traffic.cpp). No tensor arguments, so there is nothing to dispatch on:
  // one catch-all kernel for every backend, given with the schema.
  m.def("traffic_counters() -> int[]", TORCH_FN(torch_popxl::traffic_counters));
  m.def("add_host_bytes(int n) -> ()", TORCH_FN(torch_popxl::add_host_bytes));
  m.def(
      "add_collective_traffic(int bytes, int calls) -> ()",
      TORCH_FN(torch_popxl::add_collective_traffic));
  m.def("reset_traffic_counters() -> ()", TORCH_FN(torch_popxl::reset_traffic_counters));
  // The step cache (step_cache.cpp), catch-all like the counters.
  m.def("step_cache_begin() -> ()", TORCH_FN(torch_popxl::step_cache_begin));
  m.def("step_cache_end() -> ()", TORCH_FN(torch_popxl::step_cache_end));
  m.def("step_cache_empty() -> ()", TORCH_FN(torch_popxl::step_cache_empty));
  m.def("step_cache_set_limit(int limit) -> ()", TORCH_FN(torch_popxl::step_cache_set_limit));
  m.def("step_cache_stats() -> int[]", TORCH_FN(torch_popxl::step_cache_stats));
}

// The kernels are built only from device-generic ATen ops, so one CompositeExplicitAutograd
// registration serves CPU, CUDA and any other backend (autograd comes from the stanzas).
TORCH_LIBRARY_IMPL(torch_popxl, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_stacked", TORCH_FN(torch_popxl::all_reduce_stacked));
  m.impl("all_gather_stacked", TORCH_FN(torch_popxl::all_gather_stacked));
  m.impl("reduce_scatter_stacked", TORCH_FN(torch_popxl::reduce_scatter_stacked));
  m.impl("take_own_stacked", TORCH_FN(torch_popxl::take_own_stacked));
  m.impl("all_reduce_full", TORCH_FN(torch_popxl::all_reduce_full));
  m.impl("all_gather_full", TORCH_FN(torch_popxl::all_gather_full));
  m.impl("mm_all_reduce_stacked", TORCH_FN(torch_popxl::mm_all_reduce_stacked));
  m.impl("gemm", TORCH_FN(torch_popxl::gemm));
  m.impl("gemm_out_", TORCH_FN(torch_popxl::gemm_out_));
  m.impl("remote_load_stacked", TORCH_FN(torch_popxl::remote_load_stacked));
  m.impl("remote_store_stacked_", TORCH_FN(torch_popxl::remote_store_stacked_));
  m.impl("remote_slot_view", TORCH_FN(torch_popxl::remote_slot_view));
  m.impl("bernoulli_p_", TORCH_FN(torch_popxl::bernoulli_p_fallback));
  m.impl("adam_chain_", TORCH_FN(torch_popxl::adam_chain_));
}

// The CPU-only kernels: the counter-based mask (other backends take the fallback above) and the
// one-pass SGD update (the compiled step calls it on CPU parameters only).
TORCH_LIBRARY_IMPL(torch_popxl, CPU, m) {
  m.impl("bernoulli_p_", TORCH_FN(torch_popxl::bernoulli_p_));
  m.impl("sgd_update_", TORCH_FN(torch_popxl::sgd_update_));
}
