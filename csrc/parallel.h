// Note [threads in the extension]
//     at::parallel_for is a header template that splits its range through OpenMP pragmas. This
//     extension is built without -fopenmp (a second OpenMP runtime beside the one torch ships
//     would not follow torch.set_num_threads), so inside it at::parallel_for runs on one
//     thread. parallel_range splits [0, n) over torch's intra-op threads through
//     TensorIterator::for_each, which is compiled into libtorch: the chunks are the index
//     ranges of a scratch byte tensor that nothing reads or writes. That tensor is made once per
//     calling thread and kept, grown to the largest range asked so far (its pages are never
//     touched, so they cost address space, not memory): a call allocates no buffer.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>

namespace torch_popxl {

// n bytes of the calling thread's scratch, which only lends parallel_range its index ranges.
inline at::Tensor index_scratch(int64_t n) {
  thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < n) {
    scratch = at::empty({n}, at::TensorOptions().dtype(at::kByte));
  }
  return scratch.narrow(0, 0, n);
}

template <typename F>
void parallel_range(int64_t n, int64_t grain, const F& fn) {
  if (n <= 0) return;
  if (n <= grain || at::get_num_threads() == 1) {
    fn(int64_t{0}, n);
    return;
  }
  const at::Tensor index = index_scratch(n);
  const char* base = static_cast<const char*>(index.const_data_ptr());
  at::TensorIteratorConfig config;
  config.add_output(index).resize_outputs(false).check_all_same_dtype(false);
  at::TensorIterator iter = config.build();
  iter.for_each(
      [&](char** data, const int64_t* /*strides*/, int64_t size) {
        const int64_t begin = data[0] - base;
        fn(begin, begin + size);
      },
      grain);
}

}  // namespace torch_popxl
