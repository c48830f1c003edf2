// What the processor running this process can execute, asked once per process. The kernels
// with AVX-512 or AVX2 bodies (adam.cpp, sgd.cpp) pick them through these, never on their own.
#pragma once

#if defined(__x86_64__)
#define TORCH_POPXL_X86 1
#endif

namespace torch_popxl {

inline bool cpu_has_avx512f() {
#ifdef TORCH_POPXL_X86
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") != 0;
  }();
  return yes;
#else
  return false;
#endif
}

inline bool cpu_has_avx2_fma() {
#ifdef TORCH_POPXL_X86
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("fma") != 0;
  }();
  return yes;
#else
  return false;
#endif
}

}  // namespace torch_popxl
