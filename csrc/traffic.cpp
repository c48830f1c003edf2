// Process-global traffic counters for the simulated collectives and remote-buffer ops.
//
// What each op adds is defined by the byte-count functions in collective_common.h (see
// Note [traffic accounting] there); this file only keeps the totals.
// Host bytes are added by the Python host-IO layer through add_host_bytes.
//
// Counters are relaxed atomics: they are statistics, never used to order memory, and
// simulated replicas may run kernels from several threads.
#include "traffic.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace torch_popxl {
namespace {

enum Counter {
  kCollectiveBytes,
  kRemoteLoadBytes,
  kRemoteStoreBytes,
  kHostBytes,
  kNumCollectives,
  kNumRemoteLoads,
  kNumRemoteStores,
  kNumCounters,
};

std::atomic<int64_t> counters[kNumCounters];

void bump(Counter counter, int64_t amount) {
  counters[counter].fetch_add(amount, std::memory_order_relaxed);
}

}  // namespace

void count_collective(int64_t bytes) {
  bump(kCollectiveBytes, bytes);
  bump(kNumCollectives, 1);
}

// Collectives that run outside the stacked kernels (torch.distributed, runtime/distributed.py)
// report here. Under several processes each one counts its own replicas' share of the bytes;
// the correction for a kernel that ran over every instance's rows is negative.
void add_collective_traffic(int64_t bytes, int64_t calls) {
  TORCH_CHECK_VALUE(calls >= 0, "add_collective_traffic: expected calls >= 0, got ", calls, ".");
  bump(kCollectiveBytes, bytes);
  bump(kNumCollectives, calls);
}

void count_remote_load(int64_t bytes) {
  bump(kRemoteLoadBytes, bytes);
  bump(kNumRemoteLoads, 1);
}

void count_remote_store(int64_t bytes) {
  bump(kRemoteStoreBytes, bytes);
  bump(kNumRemoteStores, 1);
}

std::vector<int64_t> traffic_counters() {
  std::vector<int64_t> values(kNumCounters);
  for (int i = 0; i < kNumCounters; ++i) {
    values[i] = counters[i].load(std::memory_order_relaxed);
  }
  return values;
}

void add_host_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0, "add_host_bytes: expected a byte count >= 0, got ", bytes, ".");
  bump(kHostBytes, bytes);
}

void reset_traffic_counters() {
  for (auto& counter : counters) {
    counter.store(0, std::memory_order_relaxed);
  }
}

}  // namespace torch_popxl
