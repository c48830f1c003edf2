// Process-global traffic counters for the simulated collectives and remote-buffer ops.
//
// Note [traffic accounting]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The counters estimate what the ops would move on real hardware, so that tests and
// benchmarks can compare strategies (e.g. RTS versus plain data parallelism) without timing.
// Collectives are costed with the bandwidth-optimal ring algorithm. With n = bytes of one
// replica's input, G = group size and R = number of replicas, each kernel adds the bytes sent
// by every replica, summed over all R replicas:
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
