#include <ddp/ddp.hpp>

#include <cstdio>
#include <vector>

struct Matrix {  // your own tensor type
  std::vector<float> values;
  int rows, cols;
};

template <>  // one specialization adapts it to every collective
struct ddp::tensor_traits<Matrix> {
  static ddp::TensorView<float> view(Matrix& m) { return {m.values.data(), m.values.size()}; }
};

int main() {
  Matrix grad{std::vector<float>(6, 0.5f), 2, 3};
  static_assert(ddp::TensorLike<Matrix> && !ddp::CudaTensor<Matrix>);  // checked when compiled
  ddp::TensorView v = ddp::view(grad);  // what collectives see: data, size, device, stream
  std::printf("ddp %s: %zu x %s on %s\n", ddp::version().data(), v.size,
              ddp::to_string(v.dtype()).data(), ddp::to_string(v.device).c_str());
}
