// Stacked collective kernels: all_reduce, all_gather, reduce_scatter and take_own.
//
// Each kernel views the replica dim [R] as [R/(G*S), G, S] (see Grouping in
// collective_common.h) and works with ordinary ATen reductions/permutes on that view, so it
// runs on any device, on non-contiguous inputs, and inherits ATen's parallel CPU kernels
// instead of hand-written loops. The readable per-replica specification is each op stanza's
// reference function (torch_popxl/opdefs/<op>.py); tests/test_kernels.py checks the two agree.
#include "collective_common.h"
#include "kernels.h"

#include <vector>

namespace torch_popxl {
namespace {

std::vector<int64_t> concat_sizes(std::initializer_list<int64_t> head, at::IntArrayRef tail) {
  std::vector<int64_t> sizes(head);
  sizes.insert(sizes.end(), tail.begin(), tail.end());
  return sizes;
}

// [R, *rest] -> [R/(G*S), G, S, *rest]
at::Tensor grouped_view(const at::Tensor& x, const Grouping& g) {
  return x.reshape(concat_sizes({g.blocks(), g.group_size, g.stride}, x.sizes().slice(1)));
}

// Results must never alias an input: the custom-op contract forbids it, and callers mutate
// collective outputs in place (e.g. accumulate_ on a gathered weight). Contiguity keeps real
// outputs in line with the fake implementations, which allocate contiguous tensors.
at::Tensor fresh(const at::Tensor& out, const at::Tensor& input) {
  if (out.is_alias_of(input) || !out.is_contiguous()) {
    return out.clone(at::MemoryFormat::Contiguous);
  }
  return out;
}

void check_stacked(const char* op_name, const at::Tensor& x, int64_t min_dim, const char* layout) {
  TORCH_CHECK_VALUE(
      x.dim() >= min_dim, op_name, ": expected a stacked tensor ", layout,
      " with the replica dim first, got a tensor of shape ", x.sizes(), ".");
}

}  // namespace

at::Tensor all_reduce_stacked(
    const at::Tensor& x, c10::string_view op, int64_t group_size, int64_t stride) {
  const char* name = "all_reduce";
  check_stacked(name, x, 1, "[R, ...]");
  const Grouping g = check_grouping(name, x.size(0), group_size, stride);
  const ReduceOp rop = parse_reduce_op(name, op, /*allow_local=*/false);
  check_reduce_dtype(name, x.scalar_type(), op, rop);

  const at::Tensor xv = grouped_view(x, g);
  const at::Tensor reduced = reduce_over(xv, 1, rop, /*keepdim=*/true);  // [B, 1, S, *rest]
  const at::Tensor out = fresh(reduced.expand(xv.sizes()).reshape(x.sizes()), x);

  count_collective(all_reduce_bytes(g, bytes_per_replica(x)));
  return out;
}

at::Tensor all_gather_stacked(const at::Tensor& x, int64_t group_size, int64_t stride) {
  const char* name = "all_gather";
  check_stacked(name, x, 1, "[R, ...]");
  const Grouping g = check_grouping(name, x.size(0), group_size, stride);

  // out[b, i, s, j] = x[b, j, s]: every member i of group (b, s) receives all members j.
  const at::Tensor xv = grouped_view(x, g);  // [B, G(j), S, *rest]
  std::vector<int64_t> perm = {0, 2, 1};
  for (int64_t d = 3; d < xv.dim(); ++d) perm.push_back(d);
  const at::Tensor members = xv.permute(perm).unsqueeze(1);  // [B, 1, S, G(j), *rest]
  const auto expanded_sizes =
      concat_sizes({g.blocks(), g.group_size, g.stride, g.group_size}, x.sizes().slice(1));
  const auto out_sizes = concat_sizes({g.replicas, g.group_size}, x.sizes().slice(1));
  const at::Tensor out = fresh(members.expand(expanded_sizes).reshape(out_sizes), x);

  count_collective(all_gather_bytes(g, bytes_per_replica(x)));
  return out;
}

at::Tensor reduce_scatter_stacked(
    const at::Tensor& x, c10::string_view op, int64_t group_size, int64_t stride) {
  const char* name = "reduce_scatter";
  TORCH_CHECK_VALUE(
      x.dim() == 2, name, ": expected a stacked tensor [R, n] (each replica's input already "
      "flattened), got a tensor of shape ", x.sizes(), ". Flatten with x.reshape(R, -1).");
  const Grouping g = check_grouping(name, x.size(0), group_size, stride);
  const ReduceOp rop = parse_reduce_op(name, op, /*allow_local=*/true);
  check_reduce_dtype(name, x.scalar_type(), op, rop);

  const int64_t B = g.blocks(), G = g.group_size, S = g.stride, R = g.replicas;
  const int64_t n = x.size(1);
  const int64_t chunk = (n + G - 1) / G;  // ceil(n / G), popxl.md §4.5/§5.2
  // Zero padding at the end of each flattened row, so member i's chunk is the natural,
  // contiguous slice [i*chunk, (i+1)*chunk) of the padded row.
  const at::Tensor padded = at::constant_pad_nd(x, {0, G * chunk - n}, 0);  // [R, G*chunk]

  at::Tensor out;
  if (rop == ReduceOp::Local) {
    // No reduction: replica (b, i, s) keeps chunk i of its own row, i.e. the diagonal of the
    // (member, chunk) pair of axes.
    const at::Tensor p = padded.reshape({B, G, S, G, chunk});
    const at::Tensor own = at::diagonal(p, 0, /*dim1=*/1, /*dim2=*/3);  // [B, S, chunk, G]
    out = own.permute({0, 3, 1, 2}).reshape({R, chunk});
  } else {
    const at::Tensor p = padded.reshape({B, G, S, G * chunk});
    const at::Tensor reduced = reduce_over(p, 1, rop, /*keepdim=*/true);  // [B, 1, S, G*chunk]
    // Member i of group (b, s) takes chunk i of the group's reduced row.
    out = reduced.reshape({B, S, G, chunk}).permute({0, 2, 1, 3}).reshape({R, chunk});
  }
  out = fresh(out, x);

  count_collective(
      reduce_scatter_bytes(g, chunk * static_cast<int64_t>(x.element_size()), rop));
  return out;
}

at::Tensor take_own_stacked(const at::Tensor& x, int64_t group_size, int64_t stride) {
  const char* name = "take_own";
  check_stacked(name, x, 2, "[R, G, ...]");
  const Grouping g = check_grouping(name, x.size(0), group_size, stride);
  TORCH_CHECK_VALUE(
      x.size(1) == g.group_size, name, ": expected one row per group member, i.e. dim 1 of size "
      "group_size=", g.group_size, ", got a tensor of shape ", x.sizes(), ".");

  // Replica (b, i, s) keeps row i of its own [G, ...] block: the diagonal of the
  // (member, row) pair of axes.
  const auto rest = x.sizes().slice(2);
  const at::Tensor xv =
      x.reshape(concat_sizes({g.blocks(), g.group_size, g.stride, g.group_size}, rest));
  const at::Tensor own = at::diagonal(xv, 0, /*dim1=*/1, /*dim2=*/3);  // [B, S, *rest, G]
  const at::Tensor out = fresh(own.movedim(-1, 1).reshape(concat_sizes({g.replicas}, rest)), x);
  // PopXL implements this (the grad of all-gather) as a 'local' reduce-scatter: one
  // collective call that moves no bytes between replicas.
  count_collective(0);
  return out;
}

}  // namespace torch_popxl
