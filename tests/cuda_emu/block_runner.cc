#include "tests/cuda_emu/block_runner.h"

#include <sys/mman.h>
#include <unistd.h>

#include <boost/context/fiber.hpp>
#include <boost/context/stack_context.hpp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace kvgrid::cuda_emu {
namespace {

namespace ctx = boost::context;

constexpr size_t kStackBytes = 64 * 1024;
constexpr int kMaxThreads = 1024;
constexpr int kWarp = 32;

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone, kFaulted };

struct EmuThread {
  ThreadPlace place;
  int linear = 0;
  State state = State::kRunnable;
  unsigned warp_mask = 0;
  uint64_t exchange = 0;
  ctx::fiber fiber;  // the thread, while it is suspended
  ctx::fiber sink;   // the scheduler, while the thread runs
};

// kMaxThreads stacks reserved once, each with a guard page below it, so that a kernel that
// overflows its stack faults instead of writing into its neighbour's.
class StackPool {
 public:
  StackPool() {
    page_ = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    stride_ = kStackBytes + page_;
    void* p = mmap(nullptr, stride_ * kMaxThreads, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "cuda_emu: cannot reserve fiber stacks\n");
      std::abort();
    }
    base_ = static_cast<char*>(p);
    for (int i = 0; i < kMaxThreads; ++i) mprotect(base_ + i * stride_, page_, PROT_NONE);
  }
  ctx::stack_context Stack(int i) const {
    ctx::stack_context sc;
    sc.size = kStackBytes;
    sc.sp = base_ + (i + 1) * stride_;  // stacks grow down from the top of the slot
    return sc;
  }

 private:
  size_t page_ = 0;
  size_t stride_ = 0;
  char* base_ = nullptr;
};

// A stack allocator for ctx::fiber that hands out one slot of the pool and never frees it.
struct SlotStack {
  ctx::stack_context sc;
  ctx::stack_context allocate() { return sc; }
  void deallocate(ctx::stack_context&) noexcept {}
};

struct Block {
  std::vector<EmuThread> threads = std::vector<EmuThread>(kMaxThreads);
  int count = 0;
  std::unique_ptr<float4[]> shared;  // dynamic shared memory, 16-byte aligned
  size_t shared_capacity = 0;        // in float4
  std::string fault;
};

StackPool& Stacks() {
  static StackPool* pool = new StackPool();
  return *pool;
}

Block& TheBlock() {
  static Block* block = new Block();
  return *block;
}

thread_local EmuThread* current = nullptr;

EmuThread& Current() {
  if (current == nullptr) {
    std::fprintf(stderr, "cuda_emu: a device built-in was used outside a kernel\n");
    std::abort();
  }
  return *current;
}

void Suspend(State state, unsigned mask) {
  EmuThread& t = Current();
  t.state = state;
  t.warp_mask = mask;
  t.sink = std::move(t.sink).resume();
}

// Ends the launch: the thread is never resumed; RunGrid unwinds it.
[[noreturn]] void Fault(std::string message) {
  Block& b = TheBlock();
  if (b.fault.empty()) b.fault = std::move(message);
  Suspend(State::kFaulted, 0);
  std::abort();  // not reached: a faulted thread is only ever unwound
}

std::string Where(const EmuThread& t) {
  const ThreadPlace& p = t.place;
  char buf[160];
  std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", p.block_idx.x,
                p.block_idx.y, p.block_idx.z, p.thread_idx.x, p.thread_idx.y, p.thread_idx.z);
  return buf;
}

unsigned LaneBit(int linear) { return 1u << (linear % kWarp); }

// Releases what can go on after every live thread has stopped at a barrier: each warp
// barrier whose lanes have all arrived; otherwise the block barrier, when every live thread
// waits there. Returns false (with b.fault set when it is a fault) when nothing can go on.
bool Release(Block& b) {
  bool released = false;
  for (int w = 0; w * kWarp < b.count; ++w) {
    const int first = w * kWarp;
    const int last = std::min(b.count, first + kWarp);
    const unsigned exists = last - first == kWarp ? ~0u : (1u << (last - first)) - 1;
    unsigned arrived = 0, done = 0;
    for (int i = first; i < last; ++i) {
      const State s = b.threads[i].state;
      if (s == State::kAtWarpBarrier) arrived |= LaneBit(i);
      if (s == State::kDone) done |= LaneBit(i);
    }
    if (arrived == 0) continue;
    unsigned ready = 0;
    for (int i = first; i < last; ++i) {
      const EmuThread& t = b.threads[i];
      if (t.state != State::kAtWarpBarrier) continue;
      const unsigned missing = t.warp_mask & ~exists;
      const unsigned exited = t.warp_mask & done;
      if (missing != 0 || exited != 0) {
        const int lane = __builtin_ctz(missing != 0 ? missing : exited);
        b.fault = Where(t) + ": warp-synchronous call names lane " + std::to_string(lane) +
                  (missing != 0 ? ", which the block does not have" : ", which has exited");
        return false;
      }
      if ((t.warp_mask & arrived) == t.warp_mask) ready |= LaneBit(i);
    }
    for (int i = first; i < last; ++i) {
      if (ready & LaneBit(i)) {
        b.threads[i].state = State::kRunnable;
        released = true;
      }
    }
  }
  if (released) return true;
  int at_block = 0, live = 0;
  for (int i = 0; i < b.count; ++i) {
    const State s = b.threads[i].state;
    if (s == State::kDone) continue;
    ++live;
    if (s == State::kAtBlockBarrier) ++at_block;
  }
  if (live > 0 && at_block == live) {
    for (int i = 0; i < b.count; ++i) {
      if (b.threads[i].state == State::kAtBlockBarrier) b.threads[i].state = State::kRunnable;
    }
    return true;
  }
  if (live > 0) {
    b.fault = "deadlock: " + std::to_string(at_block) + " of " + std::to_string(live) +
              " live threads wait at __syncthreads, the others at warp barriers that cannot "
              "complete (" +
              Where(b.threads[0]) + " ...)";
  }
  return false;
}

}  // namespace

const ThreadPlace& Place() { return Current().place; }

void BlockBarrier() { Suspend(State::kAtBlockBarrier, 0); }

void WarpBarrier(unsigned mask) {
  const EmuThread& t = Current();
  if (!(mask & LaneBit(t.linear))) {
    Fault(Where(t) + ": warp-synchronous call whose mask leaves out the calling lane");
  }
  Suspend(State::kAtWarpBarrier, mask);
}

uint64_t WarpExchange(unsigned mask, uint64_t bits, int src_lane) {
  EmuThread& t = Current();
  t.exchange = bits;
  WarpBarrier(mask);
  uint64_t out = bits;
  if (src_lane >= 0) {
    if (!(mask & (1u << src_lane))) {
      Fault(Where(t) + ": shuffle reads lane " + std::to_string(src_lane) +
            ", which is not in its mask");
    }
    out = TheBlock().threads[(t.linear / kWarp) * kWarp + src_lane].exchange;
  }
  WarpBarrier(mask);  // no lane publishes its next value before every lane has read this one
  return out;
}

void* DynamicShared() { return TheBlock().shared.get(); }

std::string RunGrid(const LaunchConfig& config, const std::function<void()>& body) {
  Block& b = TheBlock();
  b.fault.clear();
  b.count = static_cast<int>(config.block.x * config.block.y * config.block.z);
  const size_t shared_f4 = (config.shared_bytes + sizeof(float4) - 1) / sizeof(float4);
  if (shared_f4 > b.shared_capacity) {
    b.shared.reset(new float4[shared_f4]);
    b.shared_capacity = shared_f4;
  }
  const StackPool& stacks = Stacks();
  for (unsigned bz = 0; bz < config.grid.z; ++bz) {
    for (unsigned by = 0; by < config.grid.y; ++by) {
      for (unsigned bx = 0; bx < config.grid.x; ++bx) {
        // Shared memory starts out as garbage on a GPU: all ones bits (NaN, -1) make a read
        // before a write show.
        if (shared_f4 > 0) std::memset(b.shared.get(), 0xFF, shared_f4 * sizeof(float4));
        for (int i = 0; i < b.count; ++i) {
          EmuThread& t = b.threads[i];
          t.linear = i;
          t.state = State::kRunnable;
          t.place.block_idx = {bx, by, bz};
          t.place.block_dim = config.block;
          t.place.grid_dim = config.grid;
          const unsigned x = i % config.block.x;
          const unsigned y = (i / config.block.x) % config.block.y;
          const unsigned z = i / (config.block.x * config.block.y);
          t.place.thread_idx = {x, y, z};
          EmuThread* self = &t;
          t.fiber = ctx::fiber(std::allocator_arg, SlotStack{stacks.Stack(i)},
                               [self, &body](ctx::fiber&& sink) {
                                 self->sink = std::move(sink);
                                 body();
                                 self->state = State::kDone;
                                 return std::move(self->sink);
                               });
        }
        for (;;) {
          bool all_done = true;
          for (int i = 0; i < b.count; ++i) {
            EmuThread& t = b.threads[i];
            if (t.state == State::kRunnable) {
              current = &t;
              t.fiber = std::move(t.fiber).resume();
              current = nullptr;
              if (!b.fault.empty()) break;
            }
            if (t.state != State::kDone) all_done = false;
          }
          if (!b.fault.empty() || all_done) break;
          if (!Release(b)) break;
        }
        if (!b.fault.empty()) {
          // Unwind the suspended threads' stacks before their slots are reused.
          for (int i = 0; i < b.count; ++i) b.threads[i].fiber = ctx::fiber();
          return b.fault;
        }
      }
    }
  }
  return "";
}

}  // namespace kvgrid::cuda_emu
