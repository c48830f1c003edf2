// Full-group collectives that return one (unbatched) result, and the fused
// matmul + all-reduce. See Note [replica-invariant values] and
// Note [fold replicas into the matmul] in torch_popxl/runtime/lower.py.
//
// When every replica is in one group, the result of an all-reduce or all-gather is the same
// on every replica, so the simulator keeps a single copy instead of R identical ones. The
// traffic counted is exactly what the stacked kernels count for the same collective.
#include <torch/library.h>

#include "grouping.h"
#include "kernels.h"

namespace torch_popxl {
namespace {

int64_t bytes_per_replica(const at::Tensor& x) {
  return x.size(0) == 0 ? 0 : (x.numel() / x.size(0)) * static_cast<int64_t>(x.element_size());
}

at::Tensor reduce_replicas(const at::Tensor& x, ReduceOp op) {
  const auto dtype = x.scalar_type();
  switch (op) {
    case ReduceOp::Add:
      return at::sum(x, {0}, /*keepdim=*/false, dtype);
    case ReduceOp::SquareAdd:
      return at::sum(x * x, {0}, /*keepdim=*/false, dtype);
    case ReduceOp::Mean:
      if (at::isFloatingType(dtype) || at::isComplexType(dtype)) {
        return at::mean(x, {0});
      }
      return at::div(at::sum(x, {0}, false, at::kLong), x.size(0), "trunc").to(dtype);
    case ReduceOp::Min:
      return at::amin(x, {0});
    case ReduceOp::Max:
      return at::amax(x, {0});
    case ReduceOp::And:
      return (x != 0).all(0).to(dtype);
    case ReduceOp::Or:
      return (x != 0).any(0).to(dtype);
    case ReduceOp::Local:
      break;
  }
  TORCH_CHECK_VALUE(false, "all_reduce_full: 'local' is not a reduction.");
  return x;
}

}  // namespace

// x: [R, ...] -> [...], the reduction over all R replicas (one group of size R).
at::Tensor all_reduce_full(const at::Tensor& x, c10::string_view op) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "all_reduce_full: expected [R, ...], got shape ", x.sizes(), ".");
  const int64_t R = x.size(0);
  TORCH_CHECK_VALUE(R >= 1, "all_reduce_full: needs at least one replica.");
  const ReduceOp rop = parse_reduce_op("all_reduce_full", op, /*allow_local=*/false);
  TORCH_CHECK_TYPE(
      !(x.scalar_type() == at::kBool &&
        (rop == ReduceOp::Add || rop == ReduceOp::Mean || rop == ReduceOp::SquareAdd)),
      "all_reduce_full: op '", std::string(op), "' needs a numeric dtype, got bool.");
  count_collective(2 * (R - 1) * bytes_per_replica(x));
  return reduce_replicas(x, rop).contiguous();
}

// x: [R, *s] -> [R, *s], every replica's value in member order (one group of size R).
at::Tensor all_gather_full(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "all_gather_full: expected [R, ...], got shape ", x.sizes(), ".");
  const int64_t R = x.size(0);
  count_collective(R * (R - 1) * bytes_per_replica(x));
  return x.clone(at::MemoryFormat::Contiguous);
}

// a: [R, M, K], b: [R, K, N] -> [M, N] = reduce_r(a[r] @ b[r]) with op add or mean.
// Folding the replica dim into the contraction is the same maths as R matmuls followed by
// an all-reduce, at the cost of one matmul; traffic is counted as that all-reduce.
at::Tensor mm_all_reduce_stacked(const at::Tensor& a, const at::Tensor& b, c10::string_view op) {
  TORCH_CHECK_VALUE(a.dim() == 3 && b.dim() == 3, "mm_all_reduce: expected a [R, M, K] and b ",
                    "[R, K, N], got shapes ", a.sizes(), " and ", b.sizes(), ".");
  TORCH_CHECK_VALUE(a.size(0) == b.size(0) && a.size(2) == b.size(1),
                    "mm_all_reduce: shapes ", a.sizes(), " and ", b.sizes(), " do not match.");
  TORCH_CHECK_VALUE(op == "add" || op == "mean", "mm_all_reduce: op must be 'add' or 'mean', got '",
                    std::string(op), "'.");
  const int64_t R = a.size(0), M = a.size(1), K = a.size(2), N = b.size(2);
  at::Tensor folded = at::mm(a.permute({1, 0, 2}).reshape({M, R * K}), b.reshape({R * K, N}));
  if (op == "mean") {
    folded.div_(R);
  }
  count_collective(2 * (R - 1) * M * N * static_cast<int64_t>(folded.element_size()));
  return folded;
}

}  // namespace torch_popxl

TORCH_LIBRARY_FRAGMENT(torch_popxl, m) {
  m.def("all_reduce_full(Tensor x, str op) -> Tensor");
  m.def("all_gather_full(Tensor x) -> Tensor");
  m.def("mm_all_reduce_stacked(Tensor a, Tensor b, str op) -> Tensor");
}

TORCH_LIBRARY_IMPL(torch_popxl, CompositeExplicitAutograd, m) {
  m.impl("all_reduce_full", TORCH_FN(torch_popxl::all_reduce_full));
  m.impl("all_gather_full", TORCH_FN(torch_popxl::all_gather_full));
  m.impl("mm_all_reduce_stacked", TORCH_FN(torch_popxl::mm_all_reduce_stacked));
}
