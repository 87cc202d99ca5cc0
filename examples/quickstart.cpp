#include <cstdio>
#include <ddp/ddp.hpp>
#include <vector>

struct Matrix {
  std::vector<float> values;
  int rows, cols;
};  // your own tensor type

template <>
struct ddp::tensor_traits<Matrix> {  // one specialization adapts it
  static ddp::TensorView<float> view(Matrix& m) { return {m.values.data(), m.values.size()}; }
};

int main() {
  Matrix grad{std::vector<float>(6, 0.5f), 2, 3};
  static_assert(ddp::TensorLike<Matrix> && !ddp::CudaTensor<Matrix>);  // checked when compiled
  ddp::TensorView v = ddp::view(grad);                                 // what every collective sees
  std::printf("ddp %s: %zu x %s on %s\n", ddp::version().data(), v.size,
              ddp::to_string(v.dtype()).data(), ddp::to_string(v.device).c_str());
}
