// "Distributed Synchronous SGD" from PyTorch's "Writing Distributed Applications" tutorial:
// DataPartitioner gives each rank its share of the data, and average_gradients() all-reduces every
// gradient after backward. Here the model fits a line y = 3x - 2 to noisy points. (GradientAverager
// does the same in buckets, overlapped; see fashion_mnist.cpp.)
#include <ddp/ddp.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

struct Point {
  float x, y;
};

// The tutorial's average_gradients: one all_reduce per parameter, then divide by the world size.
template <class Comm>
void average_gradients(Comm& comm, std::vector<std::vector<float>>& grads) {
  for (auto& g : grads) {
    comm.all_reduce(g, ddp::ReduceOp::sum);
    for (auto& v : g) v /= static_cast<float>(comm.size());
  }
}

void run(ddp::Environment env) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
  std::vector<Point> data;
  for (int i = 0; i < 1200; ++i) {
    const float x = static_cast<float>(i % 100) / 50.0f - 1.0f;
    data.push_back({x, 3 * x - 2 + 0.1f * std::sin(static_cast<float>(i) * 12.9898f)});
  }
  const int size = comm.size();
  ddp::DataPartitioner partitioner(data,
                                   std::vector<double>(static_cast<std::size_t>(size), 1.0 / size));
  const auto part = partitioner.use(comm.rank());  // this rank's share, the same split everywhere
  float w = 0, b = 0;
  std::vector<std::vector<float>> grads{{0}, {0}};
  const std::size_t bsz = 128 / static_cast<std::size_t>(size);
  for (int epoch = 0; epoch < 10; ++epoch) {
    float epoch_loss = 0;
    int batches = 0;
    for (std::size_t first = 0; first < part.size(); first += bsz, ++batches) {
      const std::size_t n = std::min(bsz, part.size() - first);
      float gw = 0, gb = 0, loss = 0;
      for (std::size_t k = first; k < first + n; ++k) {
        const Point p = part[k];
        const float err = w * p.x + b - p.y;
        loss += err * err / static_cast<float>(n);
        gw += 2 * err * p.x / static_cast<float>(n);
        gb += 2 * err / static_cast<float>(n);
      }
      grads[0][0] = gw;
      grads[1][0] = gb;
      average_gradients(comm, grads);
      w -= 0.1f * grads[0][0];
      b -= 0.1f * grads[1][0];
      epoch_loss += loss;
    }
    if (epoch == 9 || epoch == 0)
      std::printf("Rank %d, epoch %d: loss %.4f\n", comm.rank(), epoch,
                  epoch_loss / static_cast<float>(batches));
  }
  comm.barrier();
  if (comm.rank() == 0) std::printf("w = %.2f, b = %.2f\n", w, b);
}

int main() {
  const auto env = ddp::Environment::detect();
  if (env.launcher == "none")
    ddp::spawn(3, run);
  else
    run(env);
}
