// The step cache: a CPU allocator that keeps the large blocks a simulated step frees and hands
// them to the next step.
//
// Note [step cache]
// ~~~~~~~~~~~~~~~~~
// A simulated step allocates the same large temporaries (activations, gradients, gathered
// shards) on every run. glibc serves allocations above its mmap threshold, and heap growth
// past its trim threshold, with fresh pages from the kernel: each 4 KiB page of a new block
// costs a page fault and a zero fill on first touch. For the seed MNIST step that is over
// 2,000 faults per step, more time than some of its matmuls. The simulator knows its program
// runs again with the same shapes, so while a session runs a fragment (``begin``/``end``,
// counted: concurrent sessions nest) this allocator is the CPU allocator of the process:
//
// * blocks of at least kMinCachedBytes are taken from a free list of blocks of exactly that
//   (64-byte rounded) size, or from c10::alloc_cpu when the list is empty;
// * freeing such a block, whenever and on whichever thread it happens (a tensor may outlive
//   the step), puts it back on its list, unless the lists already hold `limit` bytes;
// * smaller blocks go to the allocator that was installed before (glibc serves them from
//   memory it already owns), with that allocator's deleter.
//
// Between fragments the previous allocator is back, so the user's own torch code never sees
// this one. The allocator is never destroyed (tensors it made may be freed at any time,
// even during interpreter shutdown). `empty` returns every cached block to the system.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <unordered_map>
#include <vector>

#include "step_cache.h"

namespace torch_popxl {
namespace {

constexpr size_t kMinCachedBytes = 64 * 1024;
constexpr size_t kAlignment = 64;

class StepCache final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes < kMinCachedBytes) {
      c10::Allocator* previous = previous_;  // set before this allocator was installed
      TORCH_INTERNAL_ASSERT(previous != nullptr);
      return previous->allocate(nbytes);
    }
    const size_t size = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    void* data = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.find(size);
      if (it != free_.end() && !it->second.empty()) {
        data = it->second.back();
        it->second.pop_back();
        cached_bytes_ -= size;
        ++hits_;
      } else {
        ++misses_;
      }
    }
    if (data == nullptr) {
      data = c10::alloc_cpu(size);  // throws c10::Error when out of memory
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      live_[data] = size;
    }
    return {data, data, &StepCache::release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &StepCache::release;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  static StepCache& instance() {
    static auto* cache = new StepCache();  // never destroyed: see Note [step cache]
    return *cache;
  }

  void begin() {
    std::lock_guard<std::mutex> lock(install_mutex_);
    if (depth_++ == 0) {
      previous_ = c10::GetCPUAllocator();
      c10::SetCPUAllocator(this, kPriority);
    }
  }

  void end() {
    std::lock_guard<std::mutex> lock(install_mutex_);
    TORCH_CHECK(depth_ > 0, "step cache: end() without a matching begin().");
    if (--depth_ == 0) {
      c10::SetCPUAllocator(previous_, kPriority);
    }
  }

  void empty() {
    std::vector<void*> blocks;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [size, list] : free_) {
        blocks.insert(blocks.end(), list.begin(), list.end());
      }
      free_.clear();
      cached_bytes_ = 0;
    }
    for (void* block : blocks) {
      c10::free_cpu(block);
    }
  }

  void set_limit(int64_t limit) {
    TORCH_CHECK_VALUE(limit >= 0, "step cache: expected a limit in bytes >= 0, got ", limit, ".");
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = static_cast<size_t>(limit);
  }

  std::vector<int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    size_t live_bytes = 0;
    for (const auto& [block, size] : live_) {
      live_bytes += size;
    }
    return {
        static_cast<int64_t>(cached_bytes_), static_cast<int64_t>(live_bytes),
        static_cast<int64_t>(hits_), static_cast<int64_t>(misses_),
        static_cast<int64_t>(limit_)};
  }

 private:
  // SetCPUAllocator replaces the allocator only at a priority at least the current one's;
  // the default CPU allocator is registered at priority 0.
  static constexpr uint8_t kPriority = 0;

  static void release(void* data) {
    StepCache& self = instance();
    bool keep = false;
    {
      std::lock_guard<std::mutex> lock(self.mutex_);
      auto it = self.live_.find(data);
      if (it == self.live_.end()) {
        // A small block the previous allocator made, released through raw_deleter()
        // (raw_allocate / raw_deallocate pairs in ATen kernels).
        c10::DeleterFnPtr previous = self.previous_->raw_deleter();
        TORCH_INTERNAL_ASSERT(previous != nullptr, "step cache: freeing an unknown block");
        previous(data);
        return;
      }
      const size_t size = it->second;
      self.live_.erase(it);
      if (self.cached_bytes_ + size <= self.limit_) {
        self.free_[size].push_back(data);
        self.cached_bytes_ += size;
        keep = true;
      }
    }
    if (!keep) {
      c10::free_cpu(data);
    }
  }

  std::mutex install_mutex_;
  int depth_ = 0;
  c10::Allocator* previous_ = nullptr;

  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  std::unordered_map<void*, size_t> live_;
  size_t cached_bytes_ = 0;
  size_t limit_ = size_t{1} << 31;  // 2 GiB
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

}  // namespace

void step_cache_begin() {
  StepCache::instance().begin();
}

void step_cache_end() {
  StepCache::instance().end();
}

void step_cache_empty() {
  StepCache::instance().empty();
}

void step_cache_set_limit(int64_t limit) {
  StepCache::instance().set_limit(limit);
}

std::vector<int64_t> step_cache_stats() {
  return StepCache::instance().stats();
}

}  // namespace torch_popxl
