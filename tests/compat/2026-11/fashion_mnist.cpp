// The main job: data-parallel training of an MLP (784-256-10) on Fashion-MNIST.
//
//   ddprun --standalone --nproc-per-node 4 build/default/examples/fashion_mnist
//   build/default/examples/fashion_mnist --nproc 2        (no launcher: forks 2 ranks itself)
//
// Options: --epochs N (5), --batch N (global batch, 64), --lr X (0.1), --lr-decay X (0.7 per
// epoch), --hidden N (256),
// --data DIR (/usr/share/datasets/fashion-mnist, or $FASHION_MNIST_DIR: the IDX files, gzip'd, of
// Debian's dataset-fashion-mnist), --cache DIR (the decoded files, ./fashion-mnist-cache),
// --limit N (use the first N training images), --checkpoint FILE
// (fashion_mnist.ckpt), --nproc N (ranks to fork without a launcher, 2), --resume (continue
// from the checkpoint when there is one), --crash-once-after-epoch N (rank 1 kills itself once
// after that epoch's checkpoint: with --resume under ddprun --max-restarts 1, the restarted job
// picks up from there).
//
// What each piece of ddp does here:
//  * ZeroFirstGuard: local rank 0 decompresses the dataset into the cache once; the others wait,
//    then read the cache.
//  * DistributedSampler: each rank takes its shard of a new shuffled order every epoch; the test
//    set uses the exact mode (every image once) and ddp::Metrics for the accuracy.
//  * GradientAverager: parameters start equal on every rank (rank 0's), gradients are averaged in
//    buckets that start while the backward pass still runs (mark_ready, last layer first).
//  * Logger/Progress: rank 0 alone prints; Metrics: accuracy and loss in one collective.
//  * Checkpoint: after every epoch rank 0 saves the parameters and the epoch atomically
//    (save_checkpoint); with --resume every rank starts from it (load_checkpoint).
// The global batch is split between ranks, so 1, 2 or 4 ranks train the same model.

#include <ddp/ddp.hpp>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist_common.hpp"

namespace {

bool cfg_resume = false;  // --resume
int cfg_crash_after = 0;  // --crash-once-after-epoch

using fashion_mnist::Config;

// ---- training -------------------------------------------------------------------------------

void run(ddp::Environment env, const Config& cfg) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
  const int world = comm.size(), rank = comm.rank();
  if (cfg.batch % world != 0)
    throw std::invalid_argument("--batch " + std::to_string(cfg.batch) +
                                " must be a multiple of the number of ranks (" +
                                std::to_string(world) + ")");
  using fashion_mnist::Split;
  Split train = fashion_mnist::load(comm, cfg.data, cfg.cache, "train-images-idx3-ubyte",
                                    "train-labels-idx1-ubyte");
  const Split test = fashion_mnist::load(comm, cfg.data, cfg.cache, "t10k-images-idx3-ubyte",
                                         "t10k-labels-idx1-ubyte");
  const std::size_t n_train = cfg.limit > 0 ? std::min(cfg.limit, train.size()) : train.size();

  fashion_mnist::Mlp model(cfg.hidden);
  ddp::GradientAverager avg(comm, model);  // every rank now holds rank 0's initial parameters
  ddp::DistributedSampler sampler(n_train, world, rank, {.shuffle = true, .seed = 7});
  ddp::DistributedSampler eval(test.size(), world, rank, {.shuffle = false, .exact = true});
  const auto H = static_cast<std::size_t>(cfg.hidden);
  const std::size_t local_batch = static_cast<std::size_t>(cfg.batch / world);
  std::vector<float> h(H), dh(H), z(10);
  const ddp::Logger log(rank);  // rank 0 prints
  int first_epoch = 0;
  if (cfg_resume) {
    if (const auto ck = ddp::load_checkpoint(comm, cfg.checkpoint)) {  // every rank gets it
      if (ck->get_object<int>("hidden") != cfg.hidden)
        throw std::invalid_argument("--resume: " + cfg.checkpoint + " has another --hidden");
      for (std::size_t i = 0; i < model.params.size(); ++i)
        ck->get_values("param" + std::to_string(i), std::span(model.params[i].value));
      first_epoch = ck->get_object<int>("epoch");
      log.print("resumed from %s after epoch %d", cfg.checkpoint.c_str(), first_epoch);
    }
  }
  log.print("training on %zu images with %d rank%s (%s), global batch %d, %zu test images", n_train,
            world, world == 1 ? "" : "s", std::string(comm.backend().transport()).c_str(),
            cfg.batch, test.size());

  for (int epoch = first_epoch; epoch < cfg.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const float lr = cfg.lr * std::pow(cfg.decay, static_cast<float>(epoch));
    const auto mine = sampler.indices();
    ddp::Progress bar(log, "epoch " + std::to_string(epoch + 1) + "/" + std::to_string(cfg.epochs),
                      mine.size(), world);
    double loss_sum = 0;
    std::size_t seen = 0;
    for (std::size_t first = 0; first < mine.size(); first += local_batch) {
      const std::size_t count = std::min(local_batch, mine.size() - first);
      loss_sum += fashion_mnist::backward_batch(model, avg, train, &mine[first], count, h, dh, z);
      avg.synchronize();  // gradients now hold the average over the global batch
      for (auto& p : model.params)
        for (std::size_t k = 0; k < p.value.size(); ++k) p.value[k] -= lr * p.grad[k];
      seen += count;
      bar.update(seen, {{"loss", loss_sum / static_cast<double>(seen)}});
    }
    bar.finish();
    // Test accuracy: every test image exactly once over the ranks.
    const auto [accuracy, train_loss] =
        fashion_mnist::evaluate(comm, model, test, eval, loss_sum, seen);
    log.print("epoch %d/%d: train loss %.4f, test accuracy %.2f%%", epoch + 1, cfg.epochs,
              train_loss, 100 * accuracy);
    std::vector<std::span<const float>> values;  // rank 0's are written (all ranks hold the same)
    for (const auto& p : model.params) values.emplace_back(p.value);
    fashion_mnist::save_epoch_checkpoint(comm, cfg.checkpoint, epoch + 1, cfg.hidden, values);
    if (epoch + 1 == cfg_crash_after && rank == 1 &&
        ::access((cfg.checkpoint + ".crashed").c_str(), F_OK) != 0) {
      std::fclose(std::fopen((cfg.checkpoint + ".crashed").c_str(), "w"));
      std::fprintf(stderr, "rank 1 crashes on purpose after epoch %d\n", epoch + 1);
      ::raise(SIGKILL);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config defaults;
    defaults.checkpoint = "fashion_mnist.ckpt";
    const Config cfg =
        fashion_mnist::parse(argc, argv, defaults, "fashion_mnist.cpp",
                             [](const std::string& a, const std::function<std::string()>& next) {
                               if (a == "--resume")
                                 cfg_resume = true;
                               else if (a == "--crash-once-after-epoch")
                                 cfg_crash_after = std::stoi(next());
                               else
                                 return false;
                               return true;
                             });
    const auto env = ddp::Environment::detect();
    if (env.launcher == "none")
      ddp::spawn(cfg.nproc, [&](ddp::Environment e) { run(e, cfg); });
    else
      run(env, cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist: %s\n", e.what());
    return 1;
  }
}
