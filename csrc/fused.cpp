// Full-group collectives that return one (unbatched) result, and the fused
// matmul + all-reduce. See Note [replica-invariant values] and
// Note [fold replicas into the matmul] in torch_popxl/runtime/lower.py.
//
// When every replica is in one group, the result of an all-reduce or all-gather is the same
// on every replica, so the simulator keeps a single copy instead of R identical ones. These
// are the case G = R, S = 1 of the stacked kernels: the grouping, the reduction and the
// traffic all come from collective_common.h, so they count exactly the same bytes.
#include "collective_common.h"
#include "gemm.h"
#include "kernels.h"

namespace torch_popxl {

// x: [R, ...] -> [...], the reduction over all R replicas (one group of size R).
at::Tensor all_reduce_full(const at::Tensor& x, c10::string_view op) {
  const char* name = "all_reduce_full";
  TORCH_CHECK_VALUE(x.dim() >= 1, name, ": expected [R, ...], got shape ", x.sizes(), ".");
  const Grouping g = check_grouping(name, x.size(0), x.size(0), 1);
  const ReduceOp rop = parse_reduce_op(name, op, /*allow_local=*/false);
  check_reduce_dtype(name, x.scalar_type(), op, rop);
  count_collective(all_reduce_bytes(g, bytes_per_replica(x)));
  return reduce_over(x, 0, rop, /*keepdim=*/false).contiguous();
}

// x: [R, *s] -> [R, *s], every replica's value in member order (one group of size R).
at::Tensor all_gather_full(const at::Tensor& x) {
  const char* name = "all_gather_full";
  TORCH_CHECK_VALUE(x.dim() >= 1, name, ": expected [R, ...], got shape ", x.sizes(), ".");
  const Grouping g = check_grouping(name, x.size(0), x.size(0), 1);
  count_collective(all_gather_bytes(g, bytes_per_replica(x)));
  return x.clone(at::MemoryFormat::Contiguous);
}

// a: [R, M, K], b: [R, K, N] -> [M, N] = reduce_r(a[r] @ b[r]) for a sum-based op (add, mean).
// Folding the replica dim into the contraction is the same maths as R matmuls followed by
// an all-reduce, at the cost of one matmul; traffic is counted as that all-reduce.
at::Tensor mm_all_reduce_stacked(const at::Tensor& a, const at::Tensor& b, c10::string_view op) {
  const char* name = "mm_all_reduce";
  TORCH_CHECK_VALUE(a.dim() == 3 && b.dim() == 3, name, ": expected a [R, M, K] and b ",
                    "[R, K, N], got shapes ", a.sizes(), " and ", b.sizes(), ".");
  TORCH_CHECK_VALUE(a.size(0) == b.size(0) && a.size(2) == b.size(1), name, ": shapes ",
                    a.sizes(), " and ", b.sizes(), " do not match; expected [R, M, K] and ",
                    "[R, K, N].");
  const ReduceOp rop = parse_sum_based_op(name, op);
  const Grouping g = check_grouping(name, a.size(0), a.size(0), 1);
  const int64_t R = g.replicas, M = a.size(1), K = a.size(2), N = b.size(2);
  at::Tensor folded =
      gemm(a.permute({1, 0, 2}).reshape({M, R * K}), b.reshape({R * K, N}), c10::nullopt);
  count_collective(
      all_reduce_bytes(g, M * N * static_cast<int64_t>(folded.element_size())));
  return finish_from_sum(folded, R, rop);
}

}  // namespace torch_popxl
