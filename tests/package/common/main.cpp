// The package consumers' program: prints the version it was compiled against and uses the core
// types once, so a consumer that only finds the headers but not their dependencies fails.
#include <ddp/ddp.hpp>

#include <cstdio>
#include <vector>

int main() {
  std::vector<ddp::bfloat16> buffer(3, ddp::bfloat16(1.5f));
  const auto v = ddp::view(buffer);
  std::printf("ddp %.*s (%zu x %.*s)\n", int(ddp::version().size()), ddp::version().data(), v.size,
              int(ddp::to_string(v.dtype()).size()), ddp::to_string(v.dtype()).data());
  return v.size == 3 && float(buffer[0]) == 1.5f ? 0 : 1;
}
