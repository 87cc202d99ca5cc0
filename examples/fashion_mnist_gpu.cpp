// The main job on GPUs: the MLP of fashion_mnist.cpp (784-256-10) trained with its parameters,
// gradients, activations and the dataset in CUDA memory, one rank per process.
//
//   ddprun --standalone --nproc-per-node 4 build/default/examples/fashion_mnist_gpu   (4 GPUs)
//   ddprun --standalone --nproc-per-node 2 build/default/examples/fashion_mnist_gpu --backend host
//
// --backend nccl (the default): Communicator<backend::Nccl>, one GPU per rank (the local rank's);
//   the GradientAverager's buckets stay in device memory and a step's last buckets go out as one
//   NCCL group.
// --backend host: Communicator<backend::Host>; the gradients are staged through pinned host
//   memory, so several ranks can share one GPU (rank r uses device local_rank % devices).
// Other options as in fashion_mnist.cpp: --epochs N (5), --batch N (global, 64), --lr X (0.1),
// --lr-decay X (0.7), --hidden N (256), --data DIR, --cache DIR, --limit N, --checkpoint FILE
// (fashion_mnist_gpu.ckpt), --nproc N (ranks to fork without a launcher, 1).
// Without a CUDA device it prints "no CUDA device; skipped" and exits 0.

#include <ddp/ddp.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist_common.hpp"
#include "gpu/gpu_mlp.hpp"

namespace {

struct Config : fashion_mnist::Config {
  std::string backend = "nccl";
};

Config parse(int argc, char** argv) {
  Config c;
  c.checkpoint = "fashion_mnist_gpu.ckpt";
  c.nproc = 1;
  static_cast<fashion_mnist::Config&>(c) = fashion_mnist::parse(
      argc, argv, c, "fashion_mnist_gpu.cpp",
      [&](const std::string& a, const auto& next) {
        if (a != "--backend") return false;
        c.backend = next();
        return true;
      },
      "  --backend B       nccl (the gradients on the GPU) or host (staged through host memory)");
  if (c.backend != "nccl" && c.backend != "host")
    throw std::invalid_argument("--backend must be nccl or host");
  return c;
}

std::vector<std::uint32_t> narrow(const std::vector<std::size_t>& v) {
  return {v.begin(), v.end()};
}

template <class Backend>
void train(ddp::Environment env, const Config& cfg) {
  const int devices = ddp::cuda_device_count();
  ddp::Options options;
  options.device = env.local_rank % devices;  // NCCL: one rank per device; host: shared
  const ddp::CudaDeviceGuard bind(options.device);
  auto comm = ddp::Communicator<Backend>::init(env, options);
  const int world = comm.size(), rank = comm.rank();
  if (cfg.batch % world != 0)
    throw std::invalid_argument("--batch must be a multiple of the number of ranks");
  const auto train_host = fashion_mnist::load(comm, cfg.data, cfg.cache, "train-images-idx3-ubyte",
                                              "train-labels-idx1-ubyte");
  const auto test_host = fashion_mnist::load(comm, cfg.data, cfg.cache, "t10k-images-idx3-ubyte",
                                             "t10k-labels-idx1-ubyte");
  const std::size_t n_train =
      cfg.limit > 0 ? std::min(cfg.limit, train_host.size()) : train_host.size();

  ddp::CudaStream stream(options.device);
  const gpu_mlp::DeviceSplit train_set(train_host, options.device, stream.get());
  const gpu_mlp::DeviceSplit test_set(test_host, options.device, stream.get());
  const auto local_batch = static_cast<std::size_t>(cfg.batch / world);
  constexpr std::size_t eval_batch = 1000;
  gpu_mlp::Mlp model(cfg.hidden, std::max(local_batch, eval_batch), options.device, stream.get());
  ddp::GradientAverager avg(comm, model);  // rank 0's initial parameters everywhere
  ddp::DistributedSampler sampler(n_train, world, rank, {.shuffle = true, .seed = 7});
  ddp::DistributedSampler eval(test_set.size, world, rank, {.shuffle = false, .exact = true});
  if (rank == 0)
    std::printf(
        "training on %zu images with %d rank%s (backend::%s, cuda:%d on rank 0), global "
        "batch %d, %zu test images\n",
        n_train, world, world == 1 ? "" : "s", std::string(Backend::name).c_str(), options.device,
        cfg.batch, test_set.size);

  for (int epoch = 0; epoch < cfg.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const float lr = cfg.lr * std::pow(cfg.decay, static_cast<float>(epoch));
    const auto mine = narrow(sampler.indices());
    const auto t0 = std::chrono::steady_clock::now();
    std::size_t next_report = 0;
    for (std::size_t first = 0; first < mine.size(); first += local_batch) {
      const std::size_t count = std::min(local_batch, mine.size() - first);
      model.train_step(train_set, std::span(mine).subspan(first, count),
                       1.0f / static_cast<float>(count), [&] {
                         avg.mark_ready(3);
                         avg.mark_ready(2);
                       });
      avg.mark_ready(1);
      avg.mark_ready(0);
      avg.synchronize();  // the gradients hold the average over the global batch
      model.sgd_step(lr);
      const std::size_t seen = first + count;
      if (rank == 0 && seen >= next_report) {
        stream.synchronize();
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const int pct = static_cast<int>(100 * seen / mine.size());
        std::printf("epoch %d/%d [%-20s] %3d%%  %.0f samples/s\n", epoch + 1, cfg.epochs,
                    std::string(static_cast<std::size_t>(pct / 5), '#').c_str(), pct,
                    static_cast<double>(seen) * world / std::max(secs, 1e-9));
        std::fflush(stdout);
        next_report += mine.size() / 4;
      }
    }
    const auto [loss_sum, train_correct] = model.take_stats();
    (void)train_correct;
    const auto part = narrow(eval.indices());
    for (std::size_t first = 0; first < part.size(); first += eval_batch)
      model.evaluate(test_set,
                     std::span(part).subspan(first, std::min(eval_batch, part.size() - first)));
    const auto [test_loss, correct] = model.take_stats();
    (void)test_loss;
    const double accuracy = ddp::exact_mean(comm, correct, part.size());
    const double train_loss = ddp::exact_mean(comm, loss_sum, mine.size());
    if (rank == 0) {
      std::printf("epoch %d/%d: train loss %.4f, test accuracy %.2f%%\n", epoch + 1, cfg.epochs,
                  train_loss, 100 * accuracy);
      std::fflush(stdout);
    }
    // Collective: rank 0 writes (ddp::save_checkpoint), every rank returns once it is on disk.
    fashion_mnist::save_epoch_checkpoint(comm, cfg.checkpoint, epoch + 1, cfg.hidden,
                                         model.host_values());
  }
}

void run(ddp::Environment env, const Config& cfg) {
  if (cfg.backend == "nccl")
    train<ddp::backend::Nccl>(env, cfg);
  else
    train<ddp::backend::Host>(env, cfg);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Config cfg = parse(argc, argv);
    if (ddp::cuda_device_count_before_fork() == 0) {  // no CUDA context before spawn's fork
      std::puts("fashion_mnist_gpu: no CUDA device; skipped");
      return 0;
    }
    const auto env = ddp::Environment::detect();
    if (env.launcher == "none" && cfg.nproc > 1)
      ddp::spawn(cfg.nproc, [&](ddp::Environment e) { run(e, cfg); });
    else
      run(env, cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist_gpu: %s\n", e.what());
    return 1;
  }
}
