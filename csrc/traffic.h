// Process-global traffic counters; what each op adds is in collective_common.h (byte counts).
//
// Kept free of ATen headers so that traffic.cpp compiles in a fraction of the time.
#pragma once

#include <cstdint>
#include <vector>

namespace torch_popxl {

void count_collective(int64_t bytes);
void add_collective_traffic(int64_t bytes, int64_t calls);
void count_remote_load(int64_t bytes);
void count_remote_store(int64_t bytes);
std::vector<int64_t> traffic_counters();
void add_host_bytes(int64_t bytes);
void reset_traffic_counters();

}  // namespace torch_popxl
