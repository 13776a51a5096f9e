#include "tests/cuda_emu/block_runner.h"

#include <signal.h>
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
#include <unordered_map>
#include <vector>

namespace kvgrid::cuda_emu {
namespace {

namespace ctx = boost::context;

constexpr size_t kStackBytes = 64 * 1024;
constexpr int kMaxThreads = 1024;
constexpr int kWarp = 32;

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone, kFaulted };
enum class WarpCall { kSyncwarp, kShuffle };

struct EmuThread {
  ThreadPlace place;
  int linear = 0;
  State state = State::kRunnable;
  unsigned warp_mask = 0;
  WarpCall warp_call = WarpCall::kSyncwarp;
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

// Dynamic shared memory: the opt-in maximum, ending against an unmapped page, so that a launch's
// `bytes` end there too and indexing past them faults.
class DynamicSharedArena {
 public:
  static constexpr size_t kMaxBytes = kSharedMemoryOptinBytes;
  DynamicSharedArena() {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t usable = (kMaxBytes + page - 1) / page * page;
    void* p = mmap(nullptr, usable + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::fprintf(stderr, "cuda_emu: cannot reserve shared memory\n");
      std::abort();
    }
    end_ = static_cast<char*>(p) + usable;
    mprotect(end_, page, PROT_NONE);
  }
  // `bytes` (<= kMaxBytes) of 16-byte aligned memory ending at the guard page.
  char* For(size_t bytes) const { return end_ - (bytes + 15) / 16 * 16; }

 private:
  char* end_ = nullptr;
};

struct Block {
  std::vector<EmuThread> threads = std::vector<EmuThread>(kMaxThreads);
  int count = 0;
  DynamicSharedArena arena;
  char* shared = nullptr;  // this launch's dynamic shared memory
  uint64_t generation = 0;  // counts blocks run, from 1
  std::unordered_map<void*, uint64_t> poisoned;  // static __shared__ -> the block that filled it
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
const LaunchConfig* running = nullptr;  // the grid RunGrid runs, for the fault handler

// Order of blocks and of threads within a scheduling pass: ascending, or descending with
// KVGRID_CUDA_EMU_ORDER=reverse, so that a race that one order hides shows in the other.
bool Reversed() {
  static const bool reversed = [] {
    const char* v = std::getenv("KVGRID_CUDA_EMU_ORDER");
    return v != nullptr && std::strcmp(v, "reverse") == 0;
  }();
  return reversed;
}

// A kernel that runs off an allocation (or off its stack) hits an unmapped page: say which
// launch and thread before the process dies of the signal.
void OnFault(int sig) {
  if (running != nullptr && current != nullptr) {
    const ThreadPlace& p = current->place;
    char buf[320];
    const int n = std::snprintf(
        buf, sizeof buf,
        "cuda_emu: memory fault (signal %d) in the kernel launched at %s:%d, block (%u,%u,%u) "
        "thread (%u,%u,%u): an address outside device memory, freed memory, or past an "
        "allocation's end\n",
        sig, running->site.file, running->site.line, p.block_idx.x, p.block_idx.y,
        p.block_idx.z, p.thread_idx.x, p.thread_idx.y, p.thread_idx.z);
    if (n > 0) (void)!write(2, buf, static_cast<size_t>(std::min<int>(n, sizeof buf - 1)));
  }
  // SA_RESETHAND restored the default action: returning re-runs the access, which ends the
  // process with the signal.
}

void InstallFaultHandler() {
  // The alternate stack is per thread (a fiber's overflowed stack cannot run the handler).
  thread_local bool alt_stack = [] {
    thread_local std::unique_ptr<char[]> alt(new char[64 * 1024]);
    stack_t ss{};
    ss.ss_sp = alt.get();
    ss.ss_size = 64 * 1024;
    sigaltstack(&ss, nullptr);
    return true;
  }();
  (void)alt_stack;
  static bool installed = [] {
    struct sigaction sa {};
    sa.sa_handler = OnFault;
    sa.sa_flags = SA_ONSTACK | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
    return true;
  }();
  (void)installed;
}

EmuThread& Current() {
  if (current == nullptr) {
    std::fprintf(stderr, "cuda_emu: a device built-in was used outside a kernel\n");
    std::abort();
  }
  return *current;
}

void Suspend(State state, unsigned mask, WarpCall call = WarpCall::kSyncwarp) {
  EmuThread& t = Current();
  t.state = state;
  t.warp_mask = mask;
  t.warp_call = call;
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
    unsigned arrived = 0, gone = 0;  // gone: exited lanes, and lanes the block does not have
    if (last - first < kWarp) gone = ~0u << (last - first);
    for (int i = first; i < last; ++i) {
      const State s = b.threads[i].state;
      if (s == State::kAtWarpBarrier) arrived |= LaneBit(i);
      if (s == State::kDone) gone |= LaneBit(i);
    }
    if (arrived == 0) continue;
    unsigned ready = 0;
    for (int i = first; i < last; ++i) {
      const EmuThread& t = b.threads[i];
      if (t.state != State::kAtWarpBarrier) continue;
      // The lanes of the mask that have not exited must all make this same call with the same
      // mask (CUDA leaves anything else undefined); exited ones count as arrived.
      const unsigned needed = t.warp_mask & ~gone;
      if ((needed & arrived) != needed) continue;
      for (unsigned m = needed; m != 0; m &= m - 1) {
        const EmuThread& o = b.threads[first + __builtin_ctz(m)];
        if (o.warp_mask != t.warp_mask || o.warp_call != t.warp_call) {
          b.fault = Where(t) + " and " + Where(o) +
                    ": lanes of one warp meet at different warp-synchronous calls (masks or "
                    "calls differ)";
          return false;
        }
      }
      ready |= LaneBit(i);
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

void WarpCallBarrier(unsigned mask, WarpCall call) {
  const EmuThread& t = Current();
  if (!(mask & LaneBit(t.linear))) {
    Fault(Where(t) + ": warp-synchronous call whose mask leaves out the calling lane");
  }
  Suspend(State::kAtWarpBarrier, mask, call);
}

void WarpBarrier(unsigned mask) { WarpCallBarrier(mask, WarpCall::kSyncwarp); }

uint64_t WarpExchange(unsigned mask, uint64_t bits, int src_lane) {
  EmuThread& t = Current();
  t.exchange = bits;
  WarpCallBarrier(mask, WarpCall::kShuffle);
  uint64_t out = bits;
  if (src_lane >= 0) {
    const Block& b = TheBlock();
    const int src = (t.linear / kWarp) * kWarp + src_lane;
    // Reading a lane outside the mask, or one that has exited, is undefined in CUDA.
    if (!(mask & (1u << src_lane)) || src >= b.count || b.threads[src].state == State::kDone) {
      Fault(Where(t) + ": shuffle reads lane " + std::to_string(src_lane) +
            (!(mask & (1u << src_lane)) ? ", which is not in its mask"
                                         : ", which has exited or does not exist"));
    }
    out = b.threads[src].exchange;
  }
  // No lane publishes its next value before every lane has read this one.
  WarpCallBarrier(mask, WarpCall::kShuffle);
  return out;
}

void* DynamicShared() { return TheBlock().shared; }

void PoisonShared(void* p, size_t bytes) {
  Block& b = TheBlock();
  uint64_t& done = b.poisoned[p];
  if (done == b.generation) return;
  std::memset(p, 0xFF, bytes);
  done = b.generation;
}

std::string RunGrid(const LaunchConfig& config, const std::function<void()>& body) {
  InstallFaultHandler();
  Block& b = TheBlock();
  b.fault.clear();
  b.count = static_cast<int>(config.block.x * config.block.y * config.block.z);
  if (config.shared_bytes > DynamicSharedArena::kMaxBytes) {
    return "dynamic shared memory beyond the device's maximum";
  }
  b.shared = b.arena.For(config.shared_bytes);
  const StackPool& stacks = Stacks();
  const bool reversed = Reversed();
  const uint64_t blocks = uint64_t{config.grid.x} * config.grid.y * config.grid.z;
  running = &config;
  for (uint64_t n = 0; n < blocks; ++n) {
    const uint64_t flat = reversed ? blocks - 1 - n : n;
    const unsigned bx = static_cast<unsigned>(flat % config.grid.x);
    const unsigned by = static_cast<unsigned>(flat / config.grid.x % config.grid.y);
    const unsigned bz = static_cast<unsigned>(flat / (uint64_t{config.grid.x} * config.grid.y));
    // Shared memory starts out as garbage on a GPU: all ones bits (NaN, -1) make a read before
    // a write show.
    std::memset(b.shared, 0xFF, config.shared_bytes);
    ++b.generation;
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
      for (int k = 0; k < b.count; ++k) {
        EmuThread& t = b.threads[reversed ? b.count - 1 - k : k];
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
      running = nullptr;
      return b.fault;
    }
  }
  running = nullptr;
  return "";
}

}  // namespace kvgrid::cuda_emu
