// The step cache (Note [step cache] in step_cache.cpp): while at least one begin() is
// unmatched, large CPU blocks freed by a simulated step are kept for the next one.
//
// Kept free of ATen headers, like traffic.h.
#pragma once

#include <cstdint>
#include <vector>

namespace torch_popxl {

void step_cache_begin();
void step_cache_end();
void step_cache_empty();
void step_cache_set_limit(int64_t limit);
// [cached bytes, live bytes, hits, misses, limit]
std::vector<int64_t> step_cache_stats();

}  // namespace torch_popxl
