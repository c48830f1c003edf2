// Replica-grouping validation and the reduction-op table shared by the collective kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace torch_popxl {

// A validated constant-stride grouping of R replicas (popxl.md §2.1). Every kernel views the
// replica dim as [R / (G*S), G, S]: the group axis is the middle one, so replica
// r = b*G*S + i*S + s is member i of group (b, s), i.e. g(r) = s + S*b and i(r) = i, which is
// exactly the spec's g(r) = (r % S) + S*(r // (S*G)) and i(r) = (r % (S*G)) // S.
struct Grouping {
  int64_t replicas;    // R
  int64_t group_size;  // G
  int64_t stride;      // S
  int64_t blocks() const { return replicas / (group_size * stride); }
};

inline Grouping check_grouping(
    const char* op_name, int64_t replicas, int64_t group_size, int64_t stride) {
  TORCH_CHECK_VALUE(
      group_size >= 1 && stride >= 1, op_name, ": group_size and stride must be >= 1, got group_size=",
      group_size, ", stride=", stride, ".");
  // PopXL forces the stride to 1 when the group size is 1 (popxl.md §2.1); every replica is
  // then alone in its group whatever the stride, so accept any stride instead of rejecting
  // e.g. (G=1, S=2) for a single replica.
  if (group_size == 1) {
    stride = 1;
  }
  TORCH_CHECK_VALUE(
      replicas >= 1 && replicas % (group_size * stride) == 0, op_name,
      ": the replica grouping (group_size=", group_size, ", stride=", stride,
      ") does not tile R=", replicas, " replicas; R must be a positive multiple of "
      "group_size*stride=", group_size * stride,
      ". Pick a group_size and stride whose product divides the replica count.");
  return Grouping{replicas, group_size, stride};
}

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

}  // namespace torch_popxl
