// memcpy-bench: single-thread memcpy bandwidth at one size, the reference for the Host
// backend's large-message target. Prints "memcpy <bytes> <GB/s>" (best of 5 runs of 10 copies).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : std::size_t{64} << 20;
  std::vector<char> a(n, 1), b(n, 2);  // touched: first-touch cost is not measured
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) {
      std::memcpy(b.data(), a.data(), n);
      a[static_cast<std::size_t>(i)] = b[n - 1 - static_cast<std::size_t>(i)];  // keep the copies
    }
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 10;
    best = std::max(best, static_cast<double>(n) / s / 1e9);
  }
  std::printf("memcpy %zu %.2f\n", n, best);
}
