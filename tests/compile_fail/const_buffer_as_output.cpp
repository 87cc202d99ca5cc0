// The output of a collective must be writable: a const container is rejected.
#include <ddp/ddp.hpp>

#include <vector>

template <ddp::MutableTensor T>
void receive_into(T&& tensor) {
  (void)ddp::view(tensor);
}

int main() {
  std::vector<float> buffer(4);
#ifdef DDP_COMPILE_FAIL
  const auto& read_only = buffer;
  receive_into(read_only);  // error: not a MutableTensor
#else
  receive_into(buffer);
#endif
}
