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
// (fashion_mnist.ckpt), --nproc N (ranks to fork without a launcher, 2).
//
// What each piece of ddp does here:
//  * ZeroFirstGuard: local rank 0 decompresses the dataset into the cache once; the others wait,
//    then read the cache.
//  * DistributedSampler: each rank takes its shard of a new shuffled order every epoch; the test
//    set uses the exact mode (every image once) and exact_mean() for the accuracy.
//  * GradientAverager: parameters start equal on every rank (rank 0's), gradients are averaged in
//    buckets that start while the backward pass still runs (mark_ready, last layer first).
//  * Rank 0 alone prints progress and writes the checkpoint.
// The global batch is split between ranks, so 1, 2 or 4 ranks train the same model.

#include <ddp/ddp.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist_data.hpp"

namespace {

struct Config {
  int epochs = 5;
  int batch = 64;
  float lr = 0.1f;
  float decay = 0.7f;  // the learning rate is multiplied by this after every epoch
  int hidden = 256;
  std::string data = fashion_mnist::default_dir;
  std::string cache = "fashion-mnist-cache";
  std::size_t limit = 0;
  std::string checkpoint = "fashion_mnist.ckpt";
  int nproc = 2;
};

Config parse(int argc, char** argv) {
  Config c;
  if (const char* d = std::getenv("FASHION_MNIST_DIR")) c.data = d;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--epochs")
      c.epochs = std::stoi(next());
    else if (a == "--batch")
      c.batch = std::stoi(next());
    else if (a == "--lr")
      c.lr = std::stof(next());
    else if (a == "--lr-decay")
      c.decay = std::stof(next());
    else if (a == "--hidden")
      c.hidden = std::stoi(next());
    else if (a == "--data")
      c.data = next();
    else if (a == "--cache")
      c.cache = next();
    else if (a == "--limit")
      c.limit = std::stoul(next());
    else if (a == "--checkpoint")
      c.checkpoint = next();
    else if (a == "--nproc")
      c.nproc = std::stoi(next());
    else
      throw std::invalid_argument("unknown option " + a + " (see the top of fashion_mnist.cpp)");
  }
  if (c.epochs < 1 || c.batch < 1 || c.hidden < 1 || c.nproc < 1 || !(c.lr > 0))
    throw std::invalid_argument("--epochs, --batch, --hidden, --nproc and --lr must be positive");
  return c;
}

// ---- the model ------------------------------------------------------------------------------

struct Param {
  std::vector<float> value, grad;
};

// 784 -> hidden (ReLU) -> 10 (softmax). W1 is stored input-major (784 x hidden) so that the inner
// loops run over contiguous hidden units (they vectorize without reassociating sums).
struct Mlp {
  int hidden;
  std::vector<Param> params;  // W1 (784 x H), b1 (H), W2 (H x 10), b2 (10)
  explicit Mlp(int h) : hidden(h) {
    const auto hs = static_cast<std::size_t>(h);
    params = {{std::vector<float>(784 * hs), {}},
              {std::vector<float>(hs), {}},
              {std::vector<float>(hs * 10), {}},
              {std::vector<float>(10), {}}};
    for (auto& p : params) p.grad.resize(p.value.size());
    std::mt19937 rng(42);  // the same sequence everywhere; only rank 0's values are used anyway
    const auto init = [&](std::vector<float>& w, float fan_in) {
      const float a = std::sqrt(6.0f / fan_in);
      for (auto& x : w) x = (static_cast<float>(rng()) / 4294967296.0f * 2.0f - 1.0f) * a;
    };
    init(params[0].value, 784.0f);
    init(params[2].value, static_cast<float>(h));
  }
  std::vector<Param>& parameters() { return params; }

  // Logits of one image; keeps the hidden activations in h.
  void forward(const float* x, std::vector<float>& h, float* logits) const {
    const auto H = static_cast<std::size_t>(hidden);
    std::copy(params[1].value.begin(), params[1].value.end(), h.begin());
    const float* w1 = params[0].value.data();
    for (std::size_t i = 0; i < 784; ++i) {
      if (x[i] == 0.0f) continue;  // about half the pixels are background
      const float xi = x[i];
      const float* row = w1 + i * H;
      for (std::size_t j = 0; j < H; ++j) h[j] += xi * row[j];
    }
    for (auto& v : h) v = std::max(v, 0.0f);
    for (std::size_t c = 0; c < 10; ++c) logits[c] = params[3].value[c];
    const float* w2 = params[2].value.data();
    for (std::size_t j = 0; j < H; ++j) {
      if (h[j] == 0.0f) continue;
      for (std::size_t c = 0; c < 10; ++c) logits[c] += h[j] * w2[j * 10 + c];
    }
  }
};

// Softmax cross-entropy: returns the loss and turns logits into d(loss)/d(logits).
float softmax_xent(float* z, int label) {
  const float m = *std::max_element(z, z + 10);
  float sum = 0;
  for (int c = 0; c < 10; ++c) sum += (z[c] = std::exp(z[c] - m));
  for (int c = 0; c < 10; ++c) z[c] /= sum;
  const float loss = -std::log(std::max(z[label], 1e-30f));
  z[label] -= 1.0f;
  return loss;
}

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

  Mlp model(cfg.hidden);
  ddp::GradientAverager avg(comm, model);  // every rank now holds rank 0's initial parameters
  ddp::DistributedSampler sampler(n_train, world, rank, {.shuffle = true, .seed = 7});
  ddp::DistributedSampler eval(test.size(), world, rank, {.shuffle = false, .exact = true});
  const auto H = static_cast<std::size_t>(cfg.hidden);
  const std::size_t local_batch = static_cast<std::size_t>(cfg.batch / world);
  std::vector<float> h(H), dh(H), z(10);
  if (rank == 0)
    std::printf("training on %zu images with %d rank%s (%s), global batch %d, %zu test images\n",
                n_train, world, world == 1 ? "" : "s",
                std::string(comm.backend().transport()).c_str(), cfg.batch, test.size());

  for (int epoch = 0; epoch < cfg.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    const float lr = cfg.lr * std::pow(cfg.decay, static_cast<float>(epoch));
    const auto mine = sampler.indices();
    const auto t0 = std::chrono::steady_clock::now();
    double loss_sum = 0;
    std::size_t seen = 0, next_report = 0;
    for (std::size_t first = 0; first < mine.size(); first += local_batch) {
      const std::size_t count = std::min(local_batch, mine.size() - first);
      for (auto& p : model.params) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
      auto& g1 = model.params[0].grad;
      auto& gb1 = model.params[1].grad;
      auto& g2 = model.params[2].grad;
      auto& gb2 = model.params[3].grad;
      const float scale = 1.0f / static_cast<float>(count);
      // Backward of the last layer for the whole local batch first, so that its gradients can be
      // averaged while the first layer's are computed.
      std::vector<float> hs(count * H), dzs(count * 10);
      for (std::size_t b = 0; b < count; ++b) {
        const std::size_t s = mine[first + b];
        model.forward(&train.images[s * 784], h, z.data());
        loss_sum += softmax_xent(z.data(), train.labels[s]);
        std::copy(h.begin(), h.end(), hs.begin() + static_cast<std::ptrdiff_t>(b * H));
        for (std::size_t c = 0; c < 10; ++c) {
          dzs[b * 10 + c] = z[c] * scale;
          gb2[c] += z[c] * scale;
        }
        for (std::size_t j = 0; j < H; ++j) {
          if (h[j] == 0.0f) continue;
          for (std::size_t c = 0; c < 10; ++c) g2[j * 10 + c] += h[j] * z[c] * scale;
        }
      }
      avg.mark_ready(3);
      avg.mark_ready(2);
      const float* w2 = model.params[2].value.data();
      for (std::size_t b = 0; b < count; ++b) {
        const float* hb = &hs[b * H];
        const float* dz = &dzs[b * 10];
        for (std::size_t j = 0; j < H; ++j) {
          float d = 0;
          if (hb[j] > 0.0f)
            for (std::size_t c = 0; c < 10; ++c) d += w2[j * 10 + c] * dz[c];
          dh[j] = d;
          gb1[j] += d;
        }
        const float* x = &train.images[mine[first + b] * 784];
        for (std::size_t i = 0; i < 784; ++i) {
          if (x[i] == 0.0f) continue;
          const float xi = x[i];
          float* row = &g1[i * H];
          for (std::size_t j = 0; j < H; ++j) row[j] += xi * dh[j];
        }
      }
      avg.mark_ready(1);
      avg.mark_ready(0);
      avg.synchronize();  // gradients now hold the average over the global batch
      for (auto& p : model.params)
        for (std::size_t k = 0; k < p.value.size(); ++k) p.value[k] -= lr * p.grad[k];
      seen += count;
      if (rank == 0 && seen >= next_report) {
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        const int pct = static_cast<int>(100 * seen / mine.size());
        std::printf("epoch %d/%d [%-20s] %3d%%  loss %.4f  %.0f samples/s\n", epoch + 1, cfg.epochs,
                    std::string(static_cast<std::size_t>(pct / 5), '#').c_str(), pct,
                    loss_sum / static_cast<double>(seen),
                    static_cast<double>(seen) * world / std::max(secs, 1e-9));
        std::fflush(stdout);
        next_report += mine.size() / 4;
      }
    }
    // Test accuracy: every test image exactly once over the ranks.
    std::size_t correct = 0;
    const auto part = eval.indices();
    for (const std::size_t s : part) {
      model.forward(&test.images[s * 784], h, z.data());
      correct += static_cast<std::size_t>(std::max_element(z.begin(), z.end()) - z.begin()) ==
                 test.labels[s];
    }
    const double accuracy = ddp::exact_mean(comm, static_cast<double>(correct), part.size());
    const double train_loss = ddp::exact_mean(comm, loss_sum, seen);
    if (rank == 0) {
      std::printf("epoch %d/%d: train loss %.4f, test accuracy %.2f%%\n", epoch + 1, cfg.epochs,
                  train_loss, 100 * accuracy);
      std::ofstream ck(cfg.checkpoint + ".tmp", std::ios::binary);  // rank 0 only, atomically
      const std::uint32_t header[3] = {0x4B434444u /* "DDCK" */,
                                       static_cast<std::uint32_t>(epoch + 1),
                                       static_cast<std::uint32_t>(cfg.hidden)};
      ck.write(reinterpret_cast<const char*>(header), sizeof header);
      for (const auto& p : model.params)
        ck.write(reinterpret_cast<const char*>(p.value.data()),
                 static_cast<std::streamsize>(p.value.size() * sizeof(float)));
      ck.close();
      std::rename((cfg.checkpoint + ".tmp").c_str(), cfg.checkpoint.c_str());
      std::fflush(stdout);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Config cfg = parse(argc, argv);
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
