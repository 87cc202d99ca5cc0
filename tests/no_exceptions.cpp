// Built with -fno-exceptions: ddp still compiles, and a failure prints its message and aborts
// (DDP_THROW) instead of continuing with bad state.
#include <ddp/ddp.hpp>

#include <cstdio>
#include <vector>

int main() {
  std::vector<float> v(4);
  const auto view = ddp::view(v);
  std::printf("ok: %zu\n", view.subview(1, 3).size);
  std::fflush(stdout);
  (void)view.subview(2, 3);  // out of range: must not return
  std::printf("returned after a failure\n");
  return 0;
}
