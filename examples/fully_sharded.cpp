// Fully sharded parameters (ZeRO-3): a deep tanh network whose parameters, gradients and
// optimizer state are cut into P parts, each rank keeping one. ddp::FullyShardedAverager makes
// each rank's part only (no rank ever holds the whole model), gathers a layer's parameters just
// before the forward or backward needs them (the next layer's gather on its way meanwhile),
// frees them after, and reduce-scatters a layer's gradients into the shard as soon as its
// backward is done. SGD with momentum then runs on the shard alone.
//
// The same network trains with ddp::GradientAverager (every rank holds everything) with
// --averager gradient, on the same data to the same bits on one host; each rank prints its peak
// resident memory (VmHWM), so the two can be compared, and under a per-process memory limit
// (ulimit -v) the fully sharded run fits where the other does not.
//
//   ./fully_sharded                                   (forks 4 ranks; 16 layers of 1024)
//   ./fully_sharded --ranks 2 --width 2048 --layers 24  (100M parameters)
//   ./fully_sharded --averager gradient               (everything on every rank)
//   ddprun --nproc-per-node 4 ./fully_sharded
#include <ddp/ddp.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace {

struct Config {
  int ranks = 4, width = 1024, layers = 16, batch = 8, steps = 5;
  bool sharded = true;
};

// The initial value of element k of layer l's parameter p (0: weights, width x width, row per
// output; 1: biases), the same wherever it is made.
float initial(std::size_t l, std::size_t p, std::size_t k, int width) {
  if (p == 1) return 0.0f;
  const std::uint64_t h = (k + 1) * 0x9E3779B97F4A7C15ull ^ (l + 1) * 0xBF58476D1CE4E5B9ull;
  const float u = static_cast<float>((h >> 40) & 0xFFFFFF) / static_cast<float>(0xFFFFFF);
  return (2.0f * u - 1.0f) * std::sqrt(3.0f / static_cast<float>(width));
}

// Sample s's input and target (width values each).
float input(long s, int i) { return std::sin(0.013f * static_cast<float>(s * 31 + i)); }
float target(long s, int i) { return 0.5f * std::cos(0.007f * static_cast<float>(s * 17 + 3 * i)); }

// A layer's parameters end to end: weights (width x width), then biases (width).
struct Layer {
  std::span<float> w, b;
  Layer(std::span<float> all, int width)
      : w(all.first(static_cast<std::size_t>(width) * static_cast<std::size_t>(width))),
        b(all.subspan(w.size(), static_cast<std::size_t>(width))) {}
  Layer(std::span<float> weights, std::span<float> biases) : w(weights), b(biases) {}
};

// out[s][o] = tanh(b[o] + sum_i w[o][i] in[s][i]) (no tanh for the last layer).
void forward(const Layer& l, const std::vector<float>& in, std::vector<float>& out, int width,
             int batch, bool last) {
  const auto n = static_cast<std::size_t>(width);
  out.assign(static_cast<std::size_t>(batch) * n, 0.0f);
  for (std::size_t s = 0; s < static_cast<std::size_t>(batch); ++s)
    for (std::size_t o = 0; o < n; ++o) {
      float y = l.b[o];
      const float* w = l.w.data() + o * n;
      const float* x = in.data() + s * n;
      for (std::size_t i = 0; i < n; ++i) y += w[i] * x[i];
      out[s * n + o] = last ? y : std::tanh(y);
    }
}

// Given dL/d(out) in `g` (replaced by dL/d(in)), adds the layer's gradients into `grad`.
void backward(const Layer& l, Layer grad, const std::vector<float>& in,
              const std::vector<float>& out, std::vector<float>& g, int width, int batch,
              bool last) {
  const auto n = static_cast<std::size_t>(width);
  std::vector<float> back(g.size(), 0.0f);
  for (std::size_t s = 0; s < static_cast<std::size_t>(batch); ++s)
    for (std::size_t o = 0; o < n; ++o) {
      const float y = out[s * n + o];
      const float d = last ? g[s * n + o] : g[s * n + o] * (1.0f - y * y);
      grad.b[o] += d;
      const float* w = l.w.data() + o * n;
      float* gw = grad.w.data() + o * n;
      const float* x = in.data() + s * n;
      float* bx = back.data() + s * n;
      for (std::size_t i = 0; i < n; ++i) {
        gw[i] += d * x[i];
        bx[i] += d * w[i];
      }
    }
  g.swap(back);
}

// This rank's batch at `step`: inputs, and the loss's gradient once the output is known.
std::vector<float> inputs(const Config& c, int rank, int step) {
  const auto n = static_cast<std::size_t>(c.width);
  std::vector<float> x(static_cast<std::size_t>(c.batch) * n);
  for (int s = 0; s < c.batch; ++s)
    for (int i = 0; i < c.width; ++i)
      x[static_cast<std::size_t>(s) * n + static_cast<std::size_t>(i)] =
          input((static_cast<long>(step) * c.ranks + rank) * c.batch + s, i);
  return x;
}
float loss_grad(const Config& c, int rank, int step, const std::vector<float>& y,
                std::vector<float>& g) {
  const auto n = static_cast<std::size_t>(c.width);
  g.assign(y.size(), 0.0f);
  float loss = 0;
  const float scale = 1.0f / static_cast<float>(y.size());
  for (int s = 0; s < c.batch; ++s)
    for (int i = 0; i < c.width; ++i) {
      const std::size_t k = static_cast<std::size_t>(s) * n + static_cast<std::size_t>(i);
      const float e = y[k] - target((static_cast<long>(step) * c.ranks + rank) * c.batch + s, i);
      loss += 0.5f * e * e * scale;
      g[k] = e * scale;
    }
  return loss;
}

// SGD with momentum 0.9 over slices with `value` and `grad` views.
struct Sgd {
  std::vector<float> m;
  template <class Slices>
  void step(Slices&& slices) {
    std::size_t j = 0;
    for (auto&& s : slices) j += ddp::view(s.value).size;
    m.resize(j, 0.0f);
    j = 0;
    for (auto&& s : slices) {
      float* v = ddp::view(s.value).data;
      const float* g = ddp::view(s.grad).data;
      for (std::size_t k = 0; k < ddp::view(s.value).size; ++k, ++j) {
        m[j] = 0.9f * m[j] + g[k];
        v[k] -= 0.02f * m[j];
      }
    }
  }
};

long peak_kib() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return -1;
  char line[256];
  long kib = -1;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::sscanf(line, "VmHWM: %ld kB", &kib) == 1) break;
  std::fclose(f);
  return kib;
}

using Comm = ddp::Communicator<ddp::backend::Host>;

// Fully sharded: a layer gathered for its forward and again for its backward.
float train_sharded(Comm& comm, const Config& c, std::vector<float>& checksum) {
  const auto width = static_cast<std::size_t>(c.width);
  std::vector<std::vector<std::size_t>> units(static_cast<std::size_t>(c.layers),
                                              {width * width, width});
  ddp::FullyShardedAverager fsdp(
      comm, units, [&](std::size_t l, std::size_t p, std::size_t offset, std::span<float> v) {
        for (std::size_t k = 0; k < v.size(); ++k) v[k] = initial(l, p, offset + k, c.width);
      });
  Sgd opt;
  float loss = 0;
  const std::size_t layers = units.size();
  for (int step = 0; step < c.steps; ++step) {
    std::vector<std::vector<float>> h{inputs(c, comm.rank(), step)};
    fsdp.prefetch(0);
    for (std::size_t l = 0; l < layers; ++l) {
      const Layer layer(fsdp.gather(l), c.width);
      if (l + 1 < layers) fsdp.prefetch(l + 1);  // while this layer computes
      h.emplace_back();
      forward(layer, h[l], h[l + 1], c.width, c.batch, l + 1 == layers);
      if (l + 1 < layers) fsdp.release(l);  // the last one is kept for the backward
    }
    std::vector<float> g;
    loss = loss_grad(c, comm.rank(), step, h.back(), g);
    for (std::size_t l = layers; l-- > 0;) {
      const Layer layer(fsdp.gather(l), c.width);
      if (l > 0) fsdp.prefetch(l - 1);
      backward(layer, Layer(fsdp.grad(l), c.width), h[l], h[l + 1], g, c.width, c.batch,
               l + 1 == layers);
      fsdp.release(l);
      fsdp.reduce(l);  // reduce_scatter into the shard, in the background
    }
    fsdp.synchronize();
    opt.step(fsdp.shard());
  }
  fsdp.gather_to(0, [&](std::size_t, std::size_t, std::span<const float> v) {
    double sum = 0;
    for (const float x : v) sum += x;
    checksum.push_back(static_cast<float>(sum));
  });
  return loss;
}

// Everything on every rank: GradientAverager averages the whole model's gradients.
float train_whole(Comm& comm, const Config& c, std::vector<float>& checksum) {
  struct Param {
    std::vector<float> value, grad;
  };
  const auto width = static_cast<std::size_t>(c.width);
  std::vector<Param> net;
  for (std::size_t l = 0; l < static_cast<std::size_t>(c.layers); ++l)
    for (std::size_t p = 0; p < 2; ++p) {
      Param q{std::vector<float>(p == 0 ? width * width : width),
              std::vector<float>(p == 0 ? width * width : width)};
      for (std::size_t k = 0; k < q.value.size(); ++k) q.value[k] = initial(l, p, k, c.width);
      net.push_back(std::move(q));
    }
  ddp::GradientAverager avg(comm, net);
  Sgd opt;
  float loss = 0;
  const auto layer = [&](std::size_t l, bool grad) {
    auto& w = net[2 * l];
    auto& b = net[2 * l + 1];
    return grad ? Layer(w.grad, b.grad) : Layer(w.value, b.value);
  };
  for (int step = 0; step < c.steps; ++step) {
    std::vector<std::vector<float>> h{inputs(c, comm.rank(), step)};
    for (std::size_t l = 0; l < static_cast<std::size_t>(c.layers); ++l) {
      h.emplace_back();
      forward(layer(l, false), h[l], h[l + 1], c.width, c.batch,
              l + 1 == static_cast<std::size_t>(c.layers));
    }
    for (auto& p : net) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
    std::vector<float> g;
    loss = loss_grad(c, comm.rank(), step, h.back(), g);
    for (std::size_t l = static_cast<std::size_t>(c.layers); l-- > 0;)
      backward(layer(l, false), layer(l, true), h[l], h[l + 1], g, c.width, c.batch,
               l + 1 == static_cast<std::size_t>(c.layers));
    avg.average();
    opt.step(net);
  }
  for (const auto& p : net) {
    double sum = 0;
    for (const float x : p.value) sum += x;
    checksum.push_back(static_cast<float>(sum));
  }
  return loss;
}

void run(ddp::Environment env, Config c) {
  auto comm = Comm::init(env);
  c.ranks = comm.size();
  std::vector<float> checksum;
  const float loss = c.sharded ? train_sharded(comm, c, checksum) : train_whole(comm, c, checksum);
  const double mean = ddp::exact_mean(comm, static_cast<double>(loss), 1);
  const auto peaks = comm.all_gather_object(static_cast<std::int64_t>(peak_kib()));
  if (comm.rank() != 0) return;
  const double params = static_cast<double>(c.layers) * c.width * (c.width + 1.0);
  double sum = 0;
  for (const float x : checksum) sum += x;
  std::printf(
      "%d ranks, %s, %.1fM parameters (%.0f MiB each of values, gradients, momentum): "
      "loss after %d steps %.6f, parameter sum %.6f\n",
      c.ranks, c.sharded ? "fully sharded" : "GradientAverager", params / 1e6,
      params * 4 / 1048576.0, c.steps, mean, sum);
  for (std::size_t r = 0; r < peaks.size(); ++r)
    std::printf("rank %zu: peak resident memory %.1f MiB\n", r,
                static_cast<double>(peaks[r]) / 1024.0);
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&] {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "fully_sharded: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::string(argv[++i]);
    };
    if (a == "--ranks") {
      c.ranks = std::atoi(value().c_str());
    } else if (a == "--width") {
      c.width = std::atoi(value().c_str());
    } else if (a == "--layers") {
      c.layers = std::atoi(value().c_str());
    } else if (a == "--batch") {
      c.batch = std::atoi(value().c_str());
    } else if (a == "--steps") {
      c.steps = std::atoi(value().c_str());
    } else if (a == "--averager") {
      const std::string v = value();
      if (v != "fully_sharded" && v != "gradient") {
        std::fprintf(stderr, "fully_sharded: --averager is fully_sharded or gradient\n");
        return 2;
      }
      c.sharded = v == "fully_sharded";
    } else {
      std::fprintf(stderr,
                   "usage: fully_sharded [--ranks N] [--width D] [--layers L] [--batch B] "
                   "[--steps S] [--averager fully_sharded|gradient]\n");
      return a == "-h" || a == "--help" ? 0 : 2;
    }
  }
  if (c.ranks < 1 || c.width < 1 || c.layers < 1 || c.batch < 1 || c.steps < 1) {
    std::fprintf(stderr, "fully_sharded: every number must be at least 1\n");
    return 2;
  }
  try {
    const auto env = ddp::Environment::detect();
    if (env.launcher == "none")
      ddp::spawn(c.ranks, [&](ddp::Environment e) { run(e, c); });
    else
      run(env, c);
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "fully_sharded: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "fully_sharded: out of memory\n");
    return 1;
  }
}
