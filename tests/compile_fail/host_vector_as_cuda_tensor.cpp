// A function that enqueues work on a GPU takes only types whose traits say they are
// CUDA-resident. A host std::vector must be rejected when the program is compiled.
#include <ddp/ddp.hpp>

#include <vector>

struct DeviceBuffer {
  float* ptr = nullptr;
  std::size_t n = 0;
};

template <>
struct ddp::tensor_traits<DeviceBuffer> {
  static constexpr ddp::DeviceKind device_kind = ddp::DeviceKind::cuda;
  static ddp::TensorView<float> view(DeviceBuffer& b) { return {b.ptr, b.n, ddp::Device::cuda(0)}; }
};

template <ddp::CudaTensor T>
void enqueue_on_gpu(T& tensor) {
  (void)ddp::view(tensor);
}

int main() {
#ifdef DDP_COMPILE_FAIL
  std::vector<float> host(16);
  enqueue_on_gpu(host);  // error: std::vector<float> is host memory, not a CudaTensor
#else
  DeviceBuffer device;
  enqueue_on_gpu(device);
#endif
}
