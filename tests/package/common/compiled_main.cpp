// The package consumers' program in the separate-compilation mode (ddp::compiled): two units of
// its own, each compiled with DDP_SEPARATE_COMPILATION, and ddp's implementation unit, which the
// ddp::compiled target builds. One rank (no launcher): init, all_reduce, a store round trip.
#include <ddp/ddp.hpp>

#include <cstdio>
#include <vector>

float sum_over_ranks(ddp::Communicator<ddp::backend::Host>& comm, float x);  // compiled_sum.cpp

int main() {
#ifndef DDP_SEPARATE_COMPILATION
  std::puts("DDP_SEPARATE_COMPILATION is not defined: ddp::compiled did not set it");
  return 1;
#else
  auto comm = ddp::Communicator<ddp::backend::Host>::init();
  const float s = sum_over_ranks(comm, 2.5f);
  std::printf("compiled mode: all_reduce over %d rank(s): %g\n", comm.size(), double(s));
  return s == 2.5f * float(comm.size()) ? 0 : 1;
#endif
}
