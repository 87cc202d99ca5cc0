// sync-path-bench: what the synchronous path of Communicator<backend::Mpi> costs per call, over
// the MPI call itself and over backend::Mpi alone: a 1-float all_reduce in a world of one (no
// peer to wait for, so the library's own cost is what remains). Rounds alternate raw MPI,
// the backend alone and the Communicator; the median of each is printed.
//   build/release/bench/sync-path-bench [calls per round, default 2000000] [rounds, default 7]
// DDP_TRACE_ENTRIES=0 shows what the flight recorder costs.
#include <mpi.h>
#include <ddp/backend/mpi.hpp>
#include <ddp/communicator.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

namespace {

template <class F>
double ns_per_call(int n, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) f();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() /
         n;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  {
    const int n = argc > 1 ? std::atoi(argv[1]) : 2000000;
    const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
    auto comm = ddp::Communicator<ddp::backend::Mpi>::init();
    float x[1] = {1};
    const std::span<float> s(x, 1);
    const ddp::detail::Buf b{reinterpret_cast<std::byte*>(x), 1, ddp::DType::float32,
                             ddp::Device::cpu(), nullptr};
    std::vector<double> raw, backend, communicator;
    for (int r = 0; r < rounds; ++r) {
      raw.push_back(ns_per_call(
          n, [&] { MPI_Allreduce(MPI_IN_PLACE, x, 1, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD); }));
      backend.push_back(ns_per_call(n, [&] { comm.backend().all_reduce(b, ddp::ReduceOp::sum); }));
      communicator.push_back(ns_per_call(n, [&] { comm.all_reduce(s); }));
    }
    std::printf("1-float all_reduce, world of %d, median of %d rounds of %d calls (ns per call)\n",
                comm.size(), rounds, n);
    std::printf("raw MPI_Allreduce %.1f | backend::Mpi %.1f (+%.1f) | Communicator %.1f (+%.1f)\n",
                median(raw), median(backend), median(backend) - median(raw), median(communicator),
                median(communicator) - median(backend));
  }
  MPI_Finalize();
}
