// A tensor type of your own (here a toy framework's), adapted once, then used unchanged by the
// Communicator, the GradientAverager and the data partitioning — composed at compile time, with
// no copy into a ddp type and no virtual call.
#include <ddp/ddp.hpp>

#include <cstdio>
#include <numeric>
#include <span>
#include <vector>

namespace toy {

class Tensor {  // a row-major matrix
 public:
  Tensor(std::size_t rows, std::size_t cols, float fill = 0)
      : rows_(rows), cols_(cols), data_(rows * cols, fill) {}
  float* data() { return data_.data(); }
  const float* data() const { return data_.data(); }
  std::size_t numel() const { return data_.size(); }
  // As a dataset: one sample per row.
  std::size_t size() const { return rows_; }
  std::span<const float> operator[](std::size_t row) const {
    return {data_.data() + row * cols_, cols_};
  }

 private:
  std::size_t rows_, cols_;
  std::vector<float> data_;
};

struct Layer {  // the framework's parameter: weights and their gradient
  Tensor weight, weight_grad;
};

}  // namespace toy

// The adaptation: how ddp sees a toy::Tensor (a host buffer of floats) ...
template <>
struct ddp::tensor_traits<toy::Tensor> {
  static constexpr ddp::DeviceKind device_kind = ddp::DeviceKind::cpu;  // known when compiled
  static ddp::TensorView<float> view(toy::Tensor& t) { return {t.data(), t.numel()}; }
  static ddp::TensorView<const float> view(const toy::Tensor& t) { return {t.data(), t.numel()}; }
};
// ... and where a toy::Layer keeps its value and gradient.
template <>
struct ddp::parameter_traits<toy::Layer> {
  static toy::Tensor& value(toy::Layer& l) { return l.weight; }
  static toy::Tensor& grad(toy::Layer& l) { return l.weight_grad; }
};

static_assert(ddp::HostTensor<toy::Tensor> && ddp::Dataset<toy::Tensor> &&
              ddp::Parameter<toy::Layer>);

void run(ddp::Environment env) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
  const int r = comm.rank();

  toy::Tensor t(2, 3, static_cast<float>(r + 1));
  comm.all_reduce(t, ddp::ReduceOp::avg);  // a collective on the framework's tensor

  std::vector<toy::Layer> model{{toy::Tensor(4, 4, static_cast<float>(r)), toy::Tensor(4, 4)},
                                {toy::Tensor(1, 4, 0), toy::Tensor(1, 4)}};
  ddp::GradientAverager avg(comm, model);  // every rank now has rank 0's weights
  model[0].weight_grad = toy::Tensor(4, 4, static_cast<float>(2 * r));
  model[1].weight_grad = toy::Tensor(1, 4, 1);
  avg.average();

  toy::Tensor samples(10, 2);  // 10 samples as a dataset
  std::iota(samples.data(), samples.data() + samples.numel(), 0.0f);
  ddp::DataPartitioner part(samples, comm.size());
  const auto mine = part.use(r);

  const auto report = comm.gather_object(
      std::vector<float>{t.data()[0], model[0].weight.data()[0], model[0].weight_grad.data()[0],
                         static_cast<float>(mine.size()), mine[0][0]},
      0);
  if (r == 0) {
    for (std::size_t k = 0; k < report.size(); ++k) {
      const auto& v = report[k];
      std::printf(
          "rank %zu: all_reduce avg %.1f, weight %.1f, averaged grad %.1f, %g samples "
          "(first x %g)\n",
          k, v[0], v[1], v[2], v[3], v[4]);
    }
  }
}

int main() {
  const auto env = ddp::Environment::detect();
  if (env.launcher == "none")
    ddp::spawn(2, run);
  else
    run(env);
}
