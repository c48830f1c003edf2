// Stacked remote-buffer kernels. Every replica owns a private copy of every remote buffer
// (popxl.md §4.1), so the stacked buffer is [R, entries, *slot_shape] and replica r reads or
// writes buffer[r, offsets[r]].
//
// On hardware an out-of-range offset is undefined behaviour (popxl.md §4.3); here every offset
// is checked before any memory is touched, so a bad offset is a clear error and a failed
// store leaves the buffer unchanged.
#include "collective_common.h"
#include "kernels.h"

#include <vector>

namespace torch_popxl {
namespace {

void check_buffer(const char* op_name, const at::Tensor& buffer, int64_t buffer_id) {
  TORCH_CHECK_VALUE(
      buffer.dim() >= 2, op_name, ": expected the stacked RemoteBuffer[id=", buffer_id,
      "] of shape [R, entries, *slot_shape], got a tensor of shape ", buffer.sizes(), ".");
}

// Validates the offsets and returns them as a CPU int64 tensor of shape [R]. Every offset is
// range-checked as a 64-bit value against the buffer's entries before any memory is touched;
// nothing is ever narrowed to 32 bits, so an offset of 2**32 is out of range, not slot 0.
at::Tensor checked_offsets(
    const char* op_name, const at::Tensor& buffer, const at::Tensor& offsets, int64_t buffer_id) {
  const int64_t replicas = buffer.size(0);
  const int64_t entries = buffer.size(1);
  const auto dtype = offsets.scalar_type();
  if (at::isFloatingType(dtype) && offsets.numel() > 0) {
    // Name a NaN explicitly: "got dtype Float" alone hides where the bad index came from.
    TORCH_CHECK_TYPE(
        !offsets.isnan().any().item<bool>(), op_name, ": offsets must be an integer tensor, got "
        "dtype ", dtype, " holding NaN, for RemoteBuffer[id=", buffer_id, "]. Compute the offset "
        "as an integer (e.g. with .to(torch.int32)) and check it is not derived from a NaN.");
  }
  TORCH_CHECK_TYPE(
      at::isIntegralType(dtype, /*includeBool=*/false), op_name,
      ": offsets must be an integer tensor, got dtype ", dtype, " for RemoteBuffer[id=",
      buffer_id, "].");
  TORCH_CHECK_VALUE(
      offsets.dim() <= 1 && offsets.numel() == replicas, op_name,
      ": expected one offset per replica, i.e. offsets of shape [", replicas,
      "] to match dim 0 of RemoteBuffer[id=", buffer_id, "] (shape ", buffer.sizes(),
      "), got offsets of shape ", offsets.sizes(), ".");
  if (dtype == at::kUInt64) {
    // uint64 values of 2**63 or more would turn negative as int64: check them while unsigned.
    const at::Tensor raw = offsets.to(at::kCPU).contiguous();
    const uint64_t* values = raw.data_ptr<uint64_t>();
    for (int64_t r = 0; r < replicas; ++r) {
      TORCH_CHECK_VALUE(
          values[r] < static_cast<uint64_t>(entries), op_name, ": uint64 offset ", values[r],
          " is out of range for RemoteBuffer[id=", buffer_id, "] with ", entries,
          " entries (replica ", r, "); offsets must be in [0, ", entries, ").");
    }
  }
  const at::Tensor cpu = offsets.to(at::TensorOptions().device(at::kCPU).dtype(at::kLong))
                             .contiguous()
                             .reshape({replicas});
  const int64_t* values = cpu.data_ptr<int64_t>();
  for (int64_t r = 0; r < replicas; ++r) {
    TORCH_CHECK_VALUE(
        values[r] >= 0 && values[r] < entries, op_name, ": offset ", values[r],
        " is out of range for RemoteBuffer[id=", buffer_id, "] with ", entries,
        " entries (replica ", r, "); offsets must be in [0, ", entries, ").");
  }
  return cpu;
}

// Advanced-indexing key (replica r, slot offsets[r]) for every replica at once: it reads or
// writes only the addressed slots, even when the buffer is a non-contiguous view.
c10::List<std::optional<at::Tensor>> slot_index(
    const at::Tensor& buffer, const at::Tensor& offsets_cpu) {
  const auto options = at::TensorOptions().device(buffer.device()).dtype(at::kLong);
  c10::List<std::optional<at::Tensor>> index;
  index.push_back(at::arange(buffer.size(0), options));
  index.push_back(offsets_cpu.to(buffer.device()));
  return index;
}

// The common offset when every replica addresses the same slot (a variable's fixed slot),
// else -1. Then one strided slice reads or writes all replicas' slots, without the
// gather/scatter of advanced indexing.
int64_t common_offset(const at::Tensor& offsets_cpu) {
  const int64_t* values = offsets_cpu.data_ptr<int64_t>();
  for (int64_t r = 1; r < offsets_cpu.numel(); ++r) {
    if (values[r] != values[0]) return -1;
  }
  return offsets_cpu.numel() > 0 ? values[0] : -1;
}

int64_t slot_bytes(const at::Tensor& buffer) {
  int64_t numel = 1;
  for (int64_t d = 2; d < buffer.dim(); ++d) numel *= buffer.size(d);
  return numel * static_cast<int64_t>(buffer.element_size());
}

// Whether ``value`` is exactly the view ``buffer.select(1, offset)`` (same memory, same layout).
bool is_slot_view(const at::Tensor& buffer, int64_t offset, const at::Tensor& value) {
  if (!value.is_alias_of(buffer)) return false;
  const at::Tensor slot = buffer.select(1, offset);
  return value.data_ptr() == slot.data_ptr() && value.sizes() == slot.sizes() &&
         value.strides() == slot.strides();
}

}  // namespace

at::Tensor remote_slot_view(const at::Tensor& buffer, int64_t offset, int64_t buffer_id) {
  const char* name = "remote_slot_view";
  check_buffer(name, buffer, buffer_id);
  TORCH_CHECK_VALUE(
      offset >= 0 && offset < buffer.size(1), name, ": offset ", offset,
      " is out of range for RemoteBuffer[id=", buffer_id, "] with ", buffer.size(1),
      " entries; offsets must be in [0, ", buffer.size(1), ").");
  // Counted as the load it stands for: the bytes a real remote load of every replica's slot
  // would move.
  count_remote_load(remote_transfer_bytes(buffer.size(0), slot_bytes(buffer)));
  return buffer.select(1, offset);
}

at::Tensor remote_load_stacked(
    const at::Tensor& buffer, const at::Tensor& offsets, int64_t buffer_id) {
  const char* name = "remote_load";
  check_buffer(name, buffer, buffer_id);
  const at::Tensor offsets_cpu = checked_offsets(name, buffer, offsets, buffer_id);

  const int64_t common = common_offset(offsets_cpu);
  at::Tensor out = common >= 0 ? buffer.select(1, common)  // a view: copied below
                               : at::index(buffer, slot_index(buffer, offsets_cpu));  // [R, *slot_shape]
  if (out.is_alias_of(buffer) || !out.is_contiguous()) {
    out = out.clone(at::MemoryFormat::Contiguous);
  }
  count_remote_load(remote_transfer_bytes(buffer.size(0), slot_bytes(buffer)));
  return out;
}

void remote_store_stacked_(
    const at::Tensor& buffer, const at::Tensor& offsets, const at::Tensor& value,
    int64_t buffer_id) {
  const char* name = "remote_store";
  check_buffer(name, buffer, buffer_id);
  const at::Tensor offsets_cpu = checked_offsets(name, buffer, offsets, buffer_id);

  std::vector<int64_t> expected = {buffer.size(0)};
  for (int64_t d = 2; d < buffer.dim(); ++d) expected.push_back(buffer.size(d));
  // PopXL raises ValueError for both a shape and a dtype mismatch (popxl.md §4.2, §4.3).
  TORCH_CHECK_VALUE(
      value.sizes() == at::IntArrayRef(expected), name, ": value of shape ", value.sizes(),
      " does not match RemoteBuffer[id=", buffer_id, "]: expected [R, *slot_shape] = ",
      at::IntArrayRef(expected), " (buffer shape ", buffer.sizes(), ").");
  TORCH_CHECK_VALUE(
      value.scalar_type() == buffer.scalar_type(), name, ": value has dtype ",
      value.scalar_type(), " but RemoteBuffer[id=", buffer_id, "] holds ",
      buffer.scalar_type(), "; convert the value with .to(", buffer.scalar_type(),
      ") before storing.");
  TORCH_CHECK_VALUE(
      value.device() == buffer.device(), name, ": value is on ", value.device(),
      " but RemoteBuffer[id=", buffer_id, "] is on ", buffer.device(), ".");

  const int64_t common = common_offset(offsets_cpu);
  if (common >= 0 && is_slot_view(buffer, common, value)) {
    // The value IS the addressed slots (a view from remote_slot_view that the program updated
    // in place): the store has nothing left to move here, but it is still the program's store.
    count_remote_store(remote_transfer_bytes(buffer.size(0), slot_bytes(buffer)));
    return;
  }
  // A value that shares memory with the buffer (e.g. a view of another slot) would make the
  // indexed write read memory it is overwriting; copy it first.
  const at::Tensor source = value.is_alias_of(buffer) ? value.clone() : value;
  if (common >= 0) {
    buffer.select(1, common).copy_(source);
  } else {
    buffer.index_put_(slot_index(buffer, offsets_cpu), source);
  }
  count_remote_store(remote_transfer_bytes(buffer.size(0), slot_bytes(buffer)));
}

}  // namespace torch_popxl
