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

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

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

namespace {

struct Config {
  int epochs = 5;
  int batch = 64;
  float lr = 0.1f;
  float decay = 0.7f;  // the learning rate is multiplied by this after every epoch
  int hidden = 256;
  std::string data = "/usr/share/datasets/fashion-mnist";
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

// ---- the dataset: IDX files (big-endian header), gzip'd ------------------------------------

std::string gunzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr)
    throw std::runtime_error("cannot open " + path +
                             " (install the Debian package dataset-fashion-mnist, or pass --data)");
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  const bool ok = n == 0;
  gzclose(f);
  if (!ok) throw std::runtime_error("corrupt gzip file " + path);
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::uint32_t be32(const std::string& s, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t k = 0; k < 4; ++k) v = v << 8 | static_cast<unsigned char>(s[at + k]);
  return v;
}

struct Split {
  std::vector<float> images;  // n x 784, scaled to [0, 1]
  std::vector<std::uint8_t> labels;
  [[nodiscard]] std::size_t size() const { return labels.size(); }
};

Split parse_idx(const std::string& images, const std::string& labels) {
  if (images.size() < 16 || be32(images, 0) != 0x803 || labels.size() < 8 ||
      be32(labels, 0) != 0x801)
    throw std::runtime_error("not an IDX image/label file pair");
  const std::size_t n = be32(images, 4), rows = be32(images, 8), cols = be32(images, 12);
  if (rows * cols != 784 || be32(labels, 4) != n || images.size() != 16 + n * 784 ||
      labels.size() != 8 + n)
    throw std::runtime_error("unexpected IDX sizes");
  Split s;
  s.images.resize(n * 784);
  for (std::size_t k = 0; k < n * 784; ++k)
    s.images[k] = static_cast<float>(static_cast<unsigned char>(images[16 + k])) / 255.0f;
  s.labels.assign(labels.begin() + 8, labels.end());
  return s;
}

// Local rank 0 decompresses into the cache (written under a temporary name, then renamed); the
// other ranks of the node wait at the guard and read the cache.
template <class Comm>
Split load(Comm& comm, const Config& cfg, const char* images, const char* labels) {
  {
    ddp::ZeroFirstGuard guard(comm);
    if (comm.local_rank() == 0) {
      ::mkdir(cfg.cache.c_str(), 0755);
      for (const char* name : {images, labels}) {
        const std::string out = cfg.cache + "/" + name;
        struct stat st {};
        if (::stat(out.c_str(), &st) == 0) continue;  // decoded by an earlier run
        const std::string raw = gunzip(cfg.data + "/" + name + ".gz");
        const std::string tmp = out + ".tmp" + std::to_string(::getpid());
        std::ofstream(tmp, std::ios::binary)
            .write(raw.data(), static_cast<std::streamsize>(raw.size()));
        if (std::rename(tmp.c_str(), out.c_str()) != 0)
          throw std::runtime_error("cannot write " + out);
      }
    }
  }
  return parse_idx(read_file(cfg.cache + "/" + images), read_file(cfg.cache + "/" + labels));
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
  Split train = load(comm, cfg, "train-images-idx3-ubyte", "train-labels-idx1-ubyte");
  const Split test = load(comm, cfg, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte");
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
