// One process, several GPUs (torch.nn.DataParallel's model): every device holds a replica of the
// MLP of fashion_mnist.cpp and a slice of each batch; after each backward the replicas' gradients
// are averaged through one NCCL clique (ddp::NcclClique, ncclCommInitAll), so the replicas stay
// identical without ever gathering onto the first card.
//
//   build/default/examples/data_parallel                 every visible device
//   build/default/examples/data_parallel --devices 0,2   a subset
//
// Options: --devices LIST, --epochs N (3), --batch N (per device, 64), --lr X (0.1), --lr-decay X
// (1), --hidden N (256), --data DIR, --cache DIR, --limit N. Without a CUDA device it prints
// "no CUDA device; skipped" and exits 0.

#include <ddp/ddp.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist_common.hpp"
#include "gpu/gpu_mlp.hpp"

namespace {

struct Config : fashion_mnist::Config {
  std::vector<int> devices;  // empty: all
};

Config parse(int argc, char** argv) {
  Config c;
  c.epochs = 3;
  c.decay = 1.0f;
  static_cast<fashion_mnist::Config&>(c) = fashion_mnist::parse(
      argc, argv, c, "data_parallel.cpp", [&](const std::string& a, const auto& next) {
        if (a != "--devices") return false;
        std::stringstream list(next());
        for (std::string d; std::getline(list, d, ',');) c.devices.push_back(std::stoi(d));
        return true;
      });
  return c;
}

// One device's share: its stream, dataset copy and model replica.
struct Replica {
  ddp::CudaStream stream;
  gpu_mlp::DeviceSplit train, test;
  gpu_mlp::Mlp model;
  Replica(int device, const fashion_mnist::Split& tr, const fashion_mnist::Split& te, int hidden,
          std::size_t max_batch)
      : stream(device),
        train(tr, device, stream.get()),
        test(te, device, stream.get()),
        model(hidden, max_batch, device, stream.get()) {}
};

/// The views of parameter k's values (or gradients) on every replica, in clique order.
std::vector<ddp::TensorView<float>> across(std::vector<std::unique_ptr<Replica>>& rs, std::size_t k,
                                           bool grad) {
  std::vector<ddp::TensorView<float>> out;
  for (auto& r : rs) {
    auto& p = r->model.parameters()[k];
    out.push_back(ddp::view(grad ? p.grad : p.value));
  }
  return out;
}

void run(const Config& cfg) {
  ddp::NcclClique clique(cfg.devices);
  const int n = clique.size();
  const auto un = static_cast<std::size_t>(n);
  const int batch = cfg.batch * n;  // --batch is per device
  const auto per_device = static_cast<std::size_t>(cfg.batch);
  constexpr std::size_t eval_batch = 1000;

  const auto train = fashion_mnist::load(cfg.data, cfg.cache, "train-images-idx3-ubyte",
                                         "train-labels-idx1-ubyte");
  const auto test =
      fashion_mnist::load(cfg.data, cfg.cache, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte");
  const std::size_t n_train = cfg.limit > 0 ? std::min(cfg.limit, train.size()) : train.size();
  std::vector<std::unique_ptr<Replica>> replicas;
  for (int i = 0; i < n; ++i) {
    const ddp::CudaDeviceGuard g(clique.device(i));
    replicas.push_back(std::make_unique<Replica>(clique.device(i), train, test, cfg.hidden,
                                                 std::max(per_device, eval_batch)));
  }
  for (std::size_t k = 0; k < 4; ++k) clique.broadcast(across(replicas, k, false), 0);
  std::printf("training on %zu images with %d device(s) in one process, global batch %d\n", n_train,
              n, batch);

  // Device i takes positions i, i + n, ... of each epoch's shuffled order: a DistributedSampler
  // per device, exactly as ranks would.
  std::vector<ddp::DistributedSampler> samplers;
  for (int i = 0; i < n; ++i)
    samplers.emplace_back(n_train, n, i, ddp::SamplerOptions{.shuffle = true, .seed = 7});
  double accuracy = 0;
  for (int epoch = 0; epoch < cfg.epochs; ++epoch) {
    const float lr = cfg.lr * std::pow(cfg.decay, static_cast<float>(epoch));
    std::vector<std::vector<std::uint32_t>> mine;
    for (auto& s : samplers) {
      s.set_epoch(static_cast<std::uint64_t>(epoch));
      const auto idx = s.indices();
      mine.emplace_back(idx.begin(), idx.end());
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t first = 0; first < mine[0].size(); first += per_device) {
      const std::size_t count = std::min(per_device, mine[0].size() - first);
      for (std::size_t i = 0; i < un; ++i) {  // every device computes at once (async kernels)
        const ddp::CudaDeviceGuard g(clique.device(static_cast<int>(i)));
        replicas[i]->model.train_step(replicas[i]->train, std::span(mine[i]).subspan(first, count),
                                      1.0f / static_cast<float>(count), [] {});
      }
      for (std::size_t k = 0; k < 4; ++k)
        clique.all_reduce(across(replicas, k, true), ddp::ReduceOp::avg);
      for (std::size_t i = 0; i < un; ++i) {
        const ddp::CudaDeviceGuard g(clique.device(static_cast<int>(i)));
        replicas[i]->model.sgd_step(lr);
      }
    }
    double loss = 0;
    for (std::size_t i = 0; i < un; ++i) loss += replicas[i]->model.take_stats().first;
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // Test accuracy on the first replica (they are identical).
    auto& r0 = *replicas[0];
    const ddp::CudaDeviceGuard g(clique.device(0));
    std::vector<std::uint32_t> all(test.size());
    for (std::size_t s = 0; s < all.size(); ++s) all[s] = static_cast<std::uint32_t>(s);
    for (std::size_t first = 0; first < all.size(); first += eval_batch)
      r0.model.evaluate(r0.test,
                        std::span(all).subspan(first, std::min(eval_batch, all.size() - first)));
    accuracy = r0.model.take_stats().second / static_cast<double>(all.size());
    std::printf("epoch %d/%d: train loss %.4f, test accuracy %.2f%%, %.0f samples/s\n", epoch + 1,
                cfg.epochs, loss / static_cast<double>(mine[0].size() * un), 100 * accuracy,
                static_cast<double>(mine[0].size() * un) / std::max(secs, 1e-9));
    std::fflush(stdout);
  }
  // The replicas must still be identical: their all_reduce'd updates were the same.
  for (std::size_t i = 1; i < un; ++i) {
    if (replicas[i]->model.host_values() != replicas[0]->model.host_values())
      throw std::runtime_error("the replica on device " +
                               std::to_string(clique.device(static_cast<int>(i))) +
                               " differs from the first");
  }
  std::printf("data_parallel: %d device(s), replicas identical, test accuracy %.2f%%\n", n,
              100 * accuracy);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Config cfg = parse(argc, argv);
    if (ddp::cuda_device_count() == 0) {
      std::puts("data_parallel: no CUDA device; skipped");
      return 0;
    }
    run(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_parallel: %s\n", e.what());
    return 1;
  }
}
