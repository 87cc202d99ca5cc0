// Narrowing to 16 bits is spelled out: ddp::half h{1.5f}, never ddp::half h = 1.5f.
#include <ddp/ddp.hpp>

int main() {
#ifdef DDP_COMPILE_FAIL
  ddp::half h = 1.5f;  // error: explicit constructor
#else
  ddp::half h{1.5f};
#endif
  return float(h) == 1.5f ? 0 : 1;
}
