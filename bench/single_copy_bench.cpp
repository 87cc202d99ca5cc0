// single-copy-bench: what bounds a 2-rank shared-memory all_reduce on this machine. Two forked
// processes run the bandwidth-optimal algorithm with single copies (process_vm_readv, as Open
// MPI's vader does with CMA): rank r copies half r of the peer's buffer straight out of the peer
// into a private buffer and adds it to its own half, then copies the peer's reduced half straight
// into its own buffer. Each rank receives the minimum, N bytes, with no copy through shared
// memory; what is left is cross-core copying and three handshakes. bench/README.md compares it
// with ddp's shm transport and Open MPI in alternating rounds.
//   single-copy-bench [MAX_BYTES] [CSV] [LABEL]     sizes 16 KiB to MAX_BYTES (64M; K/M/G), x4
// Prints (and writes as CSV, ddp-bench's columns) the time per all_reduce of float32 sums.
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace {

struct alignas(64) Ctl {
  std::atomic<std::uint64_t> round{0};
  std::uint64_t addr = 0;
  int pid = 0;
};

Ctl* ctl = nullptr;

void wait_for(int peer, std::uint64_t t) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (ctl[peer].round.load(std::memory_order_acquire) < t) {
    if (std::chrono::steady_clock::now() > give_up) {
      std::fprintf(stderr, "single-copy-bench: the peer stopped answering\n");
      std::_Exit(2);
    }
  }
}

void copy_out(int pid, void* dst, std::uint64_t src, std::size_t n) {
  iovec local{dst, n};
  iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(src)), n};
  if (::process_vm_readv(pid, &local, 1, &remote, 1, 0) != static_cast<ssize_t>(n)) {
    std::perror("single-copy-bench: process_vm_readv (Yama ptrace_scope may forbid it)");
    std::_Exit(3);
  }
}

std::size_t parse_size(const char* s) {
  char* end = nullptr;
  std::size_t v = std::strtoull(s, &end, 10);
  if (*end == 'K') v <<= 10;
  if (*end == 'M') v <<= 20;
  if (*end == 'G') v <<= 30;
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t max_bytes = argc > 1 ? parse_size(argv[1]) : std::size_t{64} << 20;
  const std::string csv = argc > 2 ? argv[2] : "";
  const std::string label = argc > 3 ? argv[3] : "single copy";
  void* shared = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shared == MAP_FAILED) return 1;
  ctl = new (shared) Ctl[2]{};
  const pid_t child = ::fork();
  if (child < 0) return 1;
  const int me = child == 0 ? 1 : 0, peer = 1 - me;
  const std::size_t max_count = std::max<std::size_t>(max_bytes / 4, 4096);
  std::vector<float> buf(max_count), mine(max_count);
  ctl[me].pid = ::getpid();
  ctl[me].addr = reinterpret_cast<std::uintptr_t>(buf.data());
  std::uint64_t t = 0;
  const auto publish_and_wait = [&] {
    ctl[me].round.store(++t, std::memory_order_release);
    wait_for(peer, t);
  };
  publish_and_wait();
  const int peer_pid = ctl[peer].pid;
  const std::uint64_t peer_addr = ctl[peer].addr;
  const auto all_reduce = [&](std::size_t count) {
    const std::size_t half = count / 2;
    const std::size_t lo = me == 0 ? 0 : half, n = me == 0 ? half : count - half;
    const std::size_t plo = me == 0 ? half : 0, pn = count - n;
    publish_and_wait();  // the peer's input is ready
    copy_out(peer_pid, mine.data(), peer_addr + lo * sizeof(float), n * sizeof(float));
    float* x = buf.data() + lo;
    if (me == 0) {  // rank order: rank 0's value + rank 1's, on both ranks
      for (std::size_t i = 0; i < n; ++i) x[i] = x[i] + mine[i];
    } else {
      for (std::size_t i = 0; i < n; ++i) x[i] = mine[i] + x[i];
    }
    publish_and_wait();  // the peer's half is reduced
    copy_out(peer_pid, buf.data() + plo, peer_addr + plo * sizeof(float), pn * sizeof(float));
    publish_and_wait();  // the peer is done reading this rank's buffer
  };
  std::FILE* out = nullptr;
  if (me == 0 && !csv.empty()) {
    out = std::fopen(csv.c_str(), "w");
    if (out == nullptr) return 1;
    std::fprintf(out,
                 "label,op,bytes,count,dtype,redop,time_us,algbw_gbps,busbw_gbps,iterations\n");
  }
  if (me == 0) std::printf("%12s %12s\n", "bytes", "time_us");
  int wrong = 0;
  for (std::size_t bytes = 16384; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / 4;
    for (std::size_t i = 0; i < count; ++i) buf[i] = static_cast<float>(me + 1);
    all_reduce(count);
    for (std::size_t i = 0; i < count; ++i) wrong += buf[i] != 3.0f;
    for (int i = 0; i < 5; ++i) all_reduce(count);
    // The same count on both ranks: about 0.2 s at 4 GB/s, at least 5.
    const int iters = static_cast<int>(std::max<std::size_t>(5, std::size_t{800000000} / bytes));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) all_reduce(count);
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        iters;
    if (me == 0) std::printf("%12zu %12.2f\n", bytes, us);
    if (out != nullptr) {
      const double gbps = static_cast<double>(bytes) / (us * 1e3);
      std::fprintf(out, "%s,all_reduce,%zu,%zu,float32,sum,%.3f,%.4f,%.4f,%d\n", label.c_str(),
                   bytes, count, us, gbps, gbps, iters);
    }
  }
  if (out != nullptr) std::fclose(out);
  if (me == 1) std::_Exit(wrong == 0 ? 0 : 4);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (wrong != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "single-copy-bench: wrong sums\n");
    return 4;
  }
  return 0;
}
