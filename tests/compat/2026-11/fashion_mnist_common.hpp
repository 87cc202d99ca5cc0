// What the Fashion-MNIST examples share: the dataset (Debian's dataset-fashion-mnist, IDX files
// gzip'd, read with zlib, decoded once into a cache directory that later runs and other ranks
// read directly), the command-line options, the MLP (its initial parameters, forward, a local
// batch's backward), the evaluation and the checkpoint.
#pragma once

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <ddp/ddp.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fashion_mnist {

inline constexpr const char* default_dir = "/usr/share/datasets/fashion-mnist";

// ---- options ------------------------------------------------------------------------------

struct Config {
  int epochs = 5;
  int batch = 64;
  float lr = 0.1f;
  float decay = 0.7f;  // the learning rate is multiplied by this after every epoch
  int hidden = 256;
  std::string data = default_dir;
  std::string cache = "fashion-mnist-cache";
  std::size_t limit = 0;
  std::string checkpoint;
  int nproc = 2;
};

/// Parses --epochs, --batch, --lr, --lr-decay, --hidden, --data, --cache, --limit, --checkpoint
/// and --nproc over `c` (FASHION_MNIST_DIR sets the data directory); `extra(option, next)` takes
/// a program's own options and returns false for one it does not know.
inline Config parse(int argc, char** argv, Config c, const char* program,
                    const std::function<bool(const std::string&,
                                             const std::function<std::string()>&)>& extra = {}) {
  if (const char* d = std::getenv("FASHION_MNIST_DIR")) c.data = d;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const std::function<std::string()> next = [&]() -> std::string {
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
    else if (!extra || !extra(a, next))
      throw std::invalid_argument("unknown option " + a + " (see the top of " + program + ")");
  }
  if (c.epochs < 1 || c.batch < 1 || c.hidden < 1 || c.nproc < 1 || !(c.lr > 0))
    throw std::invalid_argument("--epochs, --batch, --hidden, --nproc and --lr must be positive");
  return c;
}

// ---- the model's parameters -----------------------------------------------------------------

/// The MLP's initial W1 (784 x hidden, input-major), b1, W2 (hidden x 10), b2: uniform in
/// +-sqrt(6 / fan_in) from mt19937(42), the same sequence everywhere (only rank 0's are used).
inline std::vector<std::vector<float>> initial_parameters(int hidden) {
  const auto H = static_cast<std::size_t>(hidden);
  std::vector<std::vector<float>> p{std::vector<float>(784 * H), std::vector<float>(H),
                                    std::vector<float>(H * 10), std::vector<float>(10)};
  std::mt19937 rng(42);
  const auto uniform = [&](std::vector<float>& w, float fan_in) {
    const float a = std::sqrt(6.0f / fan_in);
    for (auto& x : w) x = (static_cast<float>(rng()) / 4294967296.0f * 2.0f - 1.0f) * a;
  };
  uniform(p[0], 784.0f);
  uniform(p[2], static_cast<float>(hidden));
  return p;
}

/// Collective: rank 0 saves the epoch, the hidden size and the parameters (host float ranges, in
/// order, as sections param0, param1, ...) with ddp::save_checkpoint: atomically, verified when
/// loaded. Every rank returns once it is on disk.
template <class Comm, class Values>
void save_epoch_checkpoint(Comm& comm, const std::string& path, int epoch, int hidden,
                           const Values& values) {
  ddp::Checkpoint ck;
  ck.put_object("epoch", epoch);
  ck.put_object("hidden", hidden);
  std::size_t i = 0;
  for (const auto& v : values) ck.put_values("param" + std::to_string(i++), v);
  ddp::save_checkpoint(comm, ck, path);
}

// ---- IDX files (big-endian header), gzip'd ----------------------------------------------------

inline std::string gunzip(const std::string& path) {
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

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline std::uint32_t be32(const std::string& s, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t k = 0; k < 4; ++k) v = v << 8 | static_cast<unsigned char>(s[at + k]);
  return v;
}

struct Split {
  std::vector<float> images;  // n x 784, scaled to [0, 1]
  std::vector<std::uint8_t> labels;
  [[nodiscard]] std::size_t size() const { return labels.size(); }
};

inline Split parse_idx(const std::string& images, const std::string& labels) {
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

/// Decompresses DATA/NAME.gz into CACHE/NAME unless an earlier run did (written under a temporary
/// name, then renamed, so a reader never sees half a file).
inline void decode_into_cache(const std::string& data, const std::string& cache, const char* name) {
  ::mkdir(cache.c_str(), 0755);
  const std::string out = cache + "/" + name;
  struct stat st {};
  if (::stat(out.c_str(), &st) == 0) return;
  const std::string raw = gunzip(data + "/" + name + ".gz");
  const std::string tmp = out + ".tmp" + std::to_string(::getpid());
  std::ofstream(tmp, std::ios::binary).write(raw.data(), static_cast<std::streamsize>(raw.size()));
  if (std::rename(tmp.c_str(), out.c_str()) != 0) throw std::runtime_error("cannot write " + out);
}

/// The split IMAGES/LABELS ("train-images-idx3-ubyte", ...), decoded through the cache.
inline Split load(const std::string& data, const std::string& cache, const char* images,
                  const char* labels) {
  for (const char* name : {images, labels}) decode_into_cache(data, cache, name);
  return parse_idx(read_file(cache + "/" + images), read_file(cache + "/" + labels));
}

/// The same across ranks: local rank 0 fills the cache first (ZeroFirstGuard); the other ranks of
/// the node wait at the guard, then read the cache.
template <class Comm>
Split load(Comm& comm, const std::string& data, const std::string& cache, const char* images,
           const char* labels) {
  {
    ddp::ZeroFirstGuard guard(comm);
    if (comm.local_rank() == 0) {
      for (const char* name : {images, labels}) decode_into_cache(data, cache, name);
    }
  }
  return parse_idx(read_file(cache + "/" + images), read_file(cache + "/" + labels));
}

/// The epoch's test accuracy and training loss, means over every sample of every rank (ranks
/// hold different numbers of test images in the exact mode), in one collective.
template <class Comm>
std::pair<double, double> epoch_metrics(Comm& comm, std::size_t correct, std::size_t n_test,
                                        double loss_sum, std::size_t seen) {
  ddp::Metrics metrics;
  const auto tested = static_cast<double>(n_test), trained = static_cast<double>(seen);
  metrics.mean("accuracy", tested == 0 ? 0.0 : static_cast<double>(correct) / tested, tested);
  metrics.mean("train_loss", trained == 0 ? 0.0 : loss_sum / trained, trained);
  const ddp::MetricValues reduced = metrics.reduce(comm);
  return {reduced["accuracy"], reduced["train_loss"]};
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
    for (auto& v : fashion_mnist::initial_parameters(h)) {
      std::vector<float> grad(v.size());
      params.push_back({std::move(v), std::move(grad)});
    }
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
inline float softmax_xent(float* z, int label) {
  const float m = *std::max_element(z, z + 10);
  float sum = 0;
  for (int c = 0; c < 10; ++c) sum += (z[c] = std::exp(z[c] - m));
  for (int c = 0; c < 10; ++c) z[c] /= sum;
  const float loss = -std::log(std::max(z[label], 1e-30f));
  z[label] -= 1.0f;
  return loss;
}

/// One local batch's forward and backward: the gradients of `count` images (`samples`) into the
/// model's (zeroed first), the last layer's marked ready to `avg` as soon as they are final, so
/// that they are averaged while the first layer's are computed. Returns the batch's summed loss.
/// h, dh: hidden-size scratch; z: 10 floats. The gradients are the sum over the images divided
/// by `per` (0: by `count`, their mean): with the nominal batch size, a short last batch makes a
/// proportionally short step.
template <class Averager, class Data>
double backward_batch(Mlp& model, Averager& avg, const Data& train, const std::size_t* samples,
                      std::size_t count, std::vector<float>& h, std::vector<float>& dh,
                      std::vector<float>& z, std::size_t per = 0) {
  const auto H = static_cast<std::size_t>(model.hidden);
  for (auto& p : model.params) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
  auto& g1 = model.params[0].grad;
  auto& gb1 = model.params[1].grad;
  auto& g2 = model.params[2].grad;
  auto& gb2 = model.params[3].grad;
  double loss = 0;
  if (per == 0) per = count;
  const float scale = count == 0 ? 0.0f : 1.0f / static_cast<float>(per);
  // Backward of the last layer for the whole local batch first, so that its gradients can be
  // averaged while the first layer's are computed.
  std::vector<float> hs(count * H), dzs(count * 10);
  for (std::size_t b = 0; b < count; ++b) {
    const std::size_t s = samples[b];
    model.forward(&train.images[s * 784], h, z.data());
    loss += softmax_xent(z.data(), train.labels[s]);
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
    const float* x = &train.images[samples[b] * 784];
    for (std::size_t i = 0; i < 784; ++i) {
      if (x[i] == 0.0f) continue;
      const float xi = x[i];
      float* row = &g1[i * H];
      for (std::size_t j = 0; j < H; ++j) row[j] += xi * dh[j];
    }
  }
  avg.mark_ready(1);
  avg.mark_ready(0);
  return loss;
}

/// The model's accuracy on the test set, every image once over the ranks (`eval`: an exact
/// DistributedSampler over `comm`), and the mean training loss of the epoch from each rank's
/// summed loss over `seen` images.
template <class Comm, class Data>
std::pair<double, double> evaluate(Comm& comm, const Mlp& model, const Data& test,
                                   const ddp::DistributedSampler& eval, double loss_sum,
                                   std::size_t seen) {
  std::vector<float> h(static_cast<std::size_t>(model.hidden)), z(10);
  std::size_t correct = 0;
  const auto part = eval.indices();
  for (const std::size_t s : part) {
    model.forward(&test.images[s * 784], h, z.data());
    correct += static_cast<std::size_t>(std::max_element(z.begin(), z.end()) - z.begin()) ==
               test.labels[s];
  }
  return epoch_metrics(comm, correct, part.size(), loss_sum, seen);
}

}  // namespace fashion_mnist
