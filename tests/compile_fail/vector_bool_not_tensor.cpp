// std::vector<bool> is not contiguous memory of a collective element type.
#include <ddp/ddp.hpp>

#include <vector>

template <ddp::TensorLike T>
void send(T& tensor) {
  (void)ddp::view(tensor);
}

int main() {
#ifdef DDP_COMPILE_FAIL
  std::vector<bool> flags(8);
  send(flags);  // error: not TensorLike
#else
  std::vector<std::uint8_t> flags(8);
  send(flags);
#endif
}
