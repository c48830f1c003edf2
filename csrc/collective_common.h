// What every collective kernel shares, in one place: replica-grouping validation and index
// math, the reduction ops (names, validity per dtype, and the reduction itself) and the
// traffic formula of each collective and remote transfer. Kernels must use these instead of
// re-deriving any of it, so a change to a formula or a check is one edit.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace torch_popxl {

// ---- groupings ------------------------------------------------------------------------------

// A validated constant-stride grouping of R replicas (popxl.md §2.1). Every kernel views the
// replica dim as [R / (G*S), G, S]: the group axis is the middle one, so replica
// r = b*G*S + i*S + s is member i of group (b, s), i.e. g(r) = s + S*b and i(r) = i, which is
// exactly the spec's g(r) = (r % S) + S*(r // (S*G)) and i(r) = (r % (S*G)) // S.
//
// Only check_grouping builds one, and it guarantees 1 <= G, 1 <= S and G*S | R with G*S <= R,
// so none of the products below can overflow or divide by zero.
struct Grouping {
  int64_t replicas;    // R
  int64_t group_size;  // G
  int64_t stride;      // S
  int64_t span() const { return group_size * stride; }
  int64_t blocks() const { return replicas / span(); }
  int64_t num_groups() const { return replicas / group_size; }
  int64_t group_of(int64_t r) const { return r % stride + stride * (r / span()); }
  int64_t index_in_group(int64_t r) const { return (r % span()) / stride; }
};

// Validates (R, G, S) before any arithmetic on them: every bound is checked with a division
// or a comparison, never a product, so huge values (e.g. G = S = 2**32, whose product wraps
// to 0 in 64 bits) are a clear error rather than a division by zero.
inline Grouping check_grouping(
    const char* op_name, int64_t replicas, int64_t group_size, int64_t stride) {
  TORCH_CHECK_VALUE(
      replicas >= 1, op_name, ": expected at least one replica (dim 0 of the stacked input), got ",
      replicas, ".");
  TORCH_CHECK_VALUE(
      group_size >= 1 && stride >= 1, op_name, ": group_size and stride must be >= 1, got group_size=",
      group_size, ", stride=", stride, ".");
  // PopXL forces the stride to 1 when the group size is 1 (popxl.md §2.1); every replica is
  // then alone in its group whatever the stride, so accept any stride instead of rejecting
  // e.g. (G=1, S=2) for a single replica.
  if (group_size == 1) {
    stride = 1;
  }
  // group_size <= R and stride <= R / group_size together mean group_size*stride <= R.
  const bool fits = group_size <= replicas && stride <= replicas / group_size;
  TORCH_CHECK_VALUE(
      fits && replicas % (group_size * stride) == 0, op_name,
      ": the replica grouping (group_size=", group_size, ", stride=", stride,
      ") does not tile R=", replicas, " replicas; R must be a positive multiple of "
      "group_size*stride", fits ? "=" : "", fits ? std::to_string(group_size * stride) : "",
      ". Pick a group_size and stride whose product divides the replica count.");
  return Grouping{replicas, group_size, stride};
}

// ---- reductions -----------------------------------------------------------------------------

// The reduction behind a collective's `op` string (popxl.md §5).
enum class ReduceOp { Add, Mean, Min, Max, And, Or, SquareAdd, Local };

inline ReduceOp parse_reduce_op(const char* op_name, c10::string_view op, bool allow_local) {
  if (op == "add") return ReduceOp::Add;
  if (op == "mean") return ReduceOp::Mean;
  // PopXL quirk (popxl.md §5): the Python string map sends 'mul' to MEAN, not to a product.
  if (op == "mul") return ReduceOp::Mean;
  if (op == "min") return ReduceOp::Min;
  if (op == "max") return ReduceOp::Max;
  if (op == "and") return ReduceOp::And;
  if (op == "or") return ReduceOp::Or;
  if (op == "square_add") return ReduceOp::SquareAdd;
  if (allow_local && op == "local") return ReduceOp::Local;
  TORCH_CHECK_VALUE(
      false, op_name, ": unknown op '", std::string(op), "'; valid ops are 'add', 'mean', "
      "'mul' (same as 'mean' in PopXL), 'min', 'max', 'and', 'or', 'square_add'",
      allow_local ? " and 'local' (no reduction)." : ".");
  return ReduceOp::Add;  // unreachable
}

// Arithmetic reductions have no meaning on bool; the logical ones and min/max do.
inline void check_reduce_dtype(
    const char* op_name, at::ScalarType dtype, c10::string_view op, ReduceOp rop) {
  const bool arithmetic =
      rop == ReduceOp::Add || rop == ReduceOp::Mean || rop == ReduceOp::SquareAdd;
  TORCH_CHECK_TYPE(
      !(arithmetic && dtype == at::kBool), op_name, ": op '", std::string(op),
      "' needs a numeric dtype, got bool. Use 'or', 'and', 'min' or 'max' for boolean masks, "
      "or convert the tensor to an integer dtype first.");
}

// The reductions that distribute over a sum, so that a kernel may first add the members'
// values by other means (the fused matmul folds them into its contraction) and then finish
// with finish_from_sum: 'add' and 'mean' (and 'mul', PopXL's alias of 'mean').
inline bool is_sum_based(ReduceOp op) { return op == ReduceOp::Add || op == ReduceOp::Mean; }

// Parses `op` for a kernel that reduces by summing first; any other reduction is a clear error.
inline ReduceOp parse_sum_based_op(const char* op_name, c10::string_view op) {
  const ReduceOp rop = parse_reduce_op(op_name, op, /*allow_local=*/false);
  TORCH_CHECK_VALUE(
      is_sum_based(rop), op_name, ": op must be 'add' or 'mean' (or 'mul', PopXL's alias of "
      "'mean'), got '", std::string(op), "'. Only reductions that distribute over a sum fold "
      "into one kernel; use a plain all-reduce for the others.");
  return rop;
}

// Turns `sum`, the (floating) sum over `members` group members, into the reduction `op` of
// them, in place: the same result reduce_over gives for a floating input.
inline at::Tensor finish_from_sum(at::Tensor sum, int64_t members, ReduceOp op) {
  TORCH_CHECK(is_sum_based(op), "finish_from_sum: not a sum-based reduction (internal error).");
  if (op == ReduceOp::Mean) {
    sum.div_(members);
  }
  return sum;
}

// Reduces x over `dim` (the group members). The result has x's dtype.
inline at::Tensor reduce_over(const at::Tensor& x, int64_t dim, ReduceOp op, bool keepdim) {
  const auto dtype = x.scalar_type();
  switch (op) {
    case ReduceOp::Add:
      return at::sum(x, {dim}, keepdim, dtype);
    case ReduceOp::SquareAdd:
      return at::sum(x * x, {dim}, keepdim, dtype);
    case ReduceOp::Mean:
      if (at::isFloatingType(dtype) || at::isComplexType(dtype)) {
        return at::mean(x, {dim}, keepdim);
      }
      // Integers: sum exactly in int64 (no intermediate overflow), then divide with C-style
      // truncation toward zero, the natural reading of "sum / G" for an integer tensor.
      return at::div(at::sum(x, {dim}, keepdim, at::kLong), x.size(dim), "trunc").to(dtype);
    case ReduceOp::Min:
      return at::amin(x, {dim}, keepdim);
    case ReduceOp::Max:
      return at::amax(x, {dim}, keepdim);
    case ReduceOp::And:
      return (x != 0).all(dim, keepdim).to(dtype);
    case ReduceOp::Or:
      return (x != 0).any(dim, keepdim).to(dtype);
    case ReduceOp::Local:
      break;
  }
  TORCH_CHECK(false, "reduce_over: 'local' is not a reduction (internal error).");
  return x;
}

// ---- byte counts ----------------------------------------------------------------------------
//
// Note [traffic accounting]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The counters (traffic.cpp) estimate what the ops would move on real hardware, so that tests
// and benchmarks can compare strategies (e.g. RTS versus plain data parallelism) without
// timing. Collectives are costed with the bandwidth-optimal ring algorithm. With n = bytes of
// one replica's input, G = group size and R = number of replicas, each function returns the
// bytes sent by every replica, summed over all R replicas:
//
//   all_reduce      per replica 2*(G-1)/G * n        total (R/G) * 2*(G-1) * n
//   all_gather      per replica (G-1) * n            total R * (G-1) * n
//   reduce_scatter  per replica (G-1)/G * padded_n   total R * (G-1) * chunk_bytes
//                   (padded_n = G * chunk_bytes, chunk = ceil(n_elems / G) elements)
//   reduce_scatter 'local' and take_own (its PopXL twin): 0 bytes
//   remote_load / remote_store: slot bytes per replica, total R * slot_bytes
//
// All totals are exact integers: the per-replica all_reduce figure can be fractional, but G
// divides R, so the sum over replicas (R/G) * 2*(G-1) * n is an integer and no rounding is
// ever needed. A group of size 1 moves 0 bytes but still counts as one collective call.
// The full-group kernels (fused.cpp) are the case G = R of the same formulas.

inline int64_t all_reduce_bytes(const Grouping& g, int64_t n) {
  return g.num_groups() * 2 * (g.group_size - 1) * n;
}

inline int64_t all_gather_bytes(const Grouping& g, int64_t n) {
  return g.replicas * (g.group_size - 1) * n;
}

inline int64_t reduce_scatter_bytes(const Grouping& g, int64_t chunk_bytes, ReduceOp op) {
  return op == ReduceOp::Local ? 0 : g.replicas * (g.group_size - 1) * chunk_bytes;
}

inline int64_t remote_transfer_bytes(int64_t replicas, int64_t slot_bytes) {
  return replicas * slot_bytes;
}

// Bytes of one replica's share of a stacked [R, ...] tensor.
inline int64_t bytes_per_replica(const at::Tensor& x) {
  return x.size(0) == 0 ? 0 : (x.numel() / x.size(0)) * static_cast<int64_t>(x.element_size());
}

}  // namespace torch_popxl
