// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
//
// fsdp-bench: a fully sharded training step with ddp and libtorch's kernels, the step that
// bench/torch/torch_fsdp.py runs with PyTorch FSDP2 (fully_shard per layer over gloo): a deep
// MLP of `layers` Linear(width, width) + tanh layers, each a unit of ddp::FullyShardedAverager,
// `batch` synthetic samples per rank, the mean of the squared outputs as loss, SGD with momentum
// on the shard, one torch thread per rank. The forward and backward are libtorch's operations
// (addmm, tanh, mm, sum) on the gathered parameters, without autograd; the gradients are written
// into the unit's gradient buffer and reduce_scattered in the background as the backward goes
// on, the next unit's parameters gathered meanwhile (--prefetch off: every gather waited for in
// turn, to measure what the overlap saves).
//
//   fsdp-bench --ranks N [--width W] [--layers L] [--batch B] [--steps S] [--warmup K]
//              [--prefetch on|off] [--compute on|off]
//
// --compute off: the same gathers, releases and reduces without the layers' arithmetic (the
// gradients are the buffers as they are): the step's communication alone.
// Prints "ms/step X" (the slowest rank's median over the timed steps) and "peak MiB Y" (the
// largest VmHWM of the ranks). Built against PyPI's libtorch by bench/torch/fsdp_compare.py,
// which runs it against torch_fsdp.py in alternating rounds.

#include <torch/torch.h>

#include <ddp/ddp.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

struct Args {
  int ranks = 2, width = 1024, layers = 8, batch = 32, steps = 20, warmup = 3;
  bool prefetch = true;
  bool compute = true;
};

double peak_mib() {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::atof(line.c_str() + 6) / 1024.0;
  }
  return 0;
}

using Comm = ddp::Communicator<ddp::backend::Host>;

torch::Tensor view(float* data, std::initializer_list<std::int64_t> shape) {
  return torch::from_blob(data, shape, torch::kFloat32);
}

void rank_main(const Args& a, const ddp::Environment& env) {
  torch::set_num_threads(1);
  torch::NoGradGuard no_grad;
  auto comm = Comm::init(env);
  const auto w = static_cast<std::size_t>(a.width);
  const auto layers = static_cast<std::size_t>(a.layers);
  std::vector<std::vector<std::size_t>> units(layers, {w * w, w});
  // nn.Linear's initialization: uniform in +-1/sqrt(width), weights and biases.
  const float bound = 1.0f / std::sqrt(static_cast<float>(a.width));
  torch::manual_seed(static_cast<std::uint64_t>(comm.rank()) + 1);
  ddp::FullyShardedAverager fsdp(
      comm, units, [&](std::size_t, std::size_t, std::size_t, std::span<float> v) {
        torch::from_blob(v.data(), {static_cast<std::int64_t>(v.size())}).uniform_(-bound, bound);
      });
  std::vector<torch::Tensor> velocity;
  for (const auto& s : fsdp.shard())
    velocity.push_back(torch::zeros({static_cast<std::int64_t>(s.value.size)}));
  const std::int64_t W = a.width, B = a.batch;
  std::vector<double> times;
  for (int step = 0; step < a.warmup + a.steps; ++step) {
    const torch::Tensor x = torch::randn({B, W});
    const auto start = std::chrono::steady_clock::now();
    std::vector<torch::Tensor> h{x};
    if (a.prefetch) fsdp.prefetch(0);
    for (std::size_t l = 0; l < layers; ++l) {
      float* p = fsdp.gather(l).data();
      if (a.prefetch && l + 1 < layers) fsdp.prefetch(l + 1);  // while this layer computes
      if (!a.compute) {
        h.push_back(h[l]);
      } else {
        h.push_back(torch::tanh(torch::addmm(view(p + w * w, {W}), h[l], view(p, {W, W}).t())));
      }
      if (l + 1 < layers) fsdp.release(l);  // the last one is kept for the backward
    }
    // loss = mean(y^2): dloss/dy = 2 y / (B W)
    torch::Tensor g = h.back() * (2.0 / static_cast<double>(B * W));
    for (std::size_t l = layers; l-- > 0;) {
      float* p = fsdp.gather(l).data();
      if (a.prefetch && l > 0) fsdp.prefetch(l - 1);
      float* dp = fsdp.grad(l).data();
      if (!a.compute) {
        fsdp.release(l);
        fsdp.reduce(l);
        continue;
      }
      const torch::Tensor& y = h[l + 1];
      const torch::Tensor gz = g * (1 - y * y);
      torch::Tensor dw = view(dp, {W, W}), db = view(dp + w * w, {W});
      torch::mm_out(dw, gz.t(), h[l]);
      torch::sum_out(db, gz, {0});
      if (l > 0) g = gz.mm(view(p, {W, W}));
      fsdp.release(l);
      fsdp.reduce(l);  // reduce_scatter into the shard, in the background
    }
    fsdp.synchronize();
    const auto slices = fsdp.shard();
    for (std::size_t s = 0; s < slices.size(); ++s) {
      const auto n = static_cast<std::int64_t>(slices[s].value.size);
      velocity[s].mul_(0.9).add_(torch::from_blob(slices[s].grad.data, {n}));
      torch::from_blob(slices[s].value.data, {n}).add_(velocity[s], -1e-3);
    }
    times.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count());
  }
  std::vector<double> timed(times.begin() + a.warmup, times.end());
  std::nth_element(timed.begin(), timed.begin() + static_cast<std::ptrdiff_t>(timed.size() / 2),
                   timed.end());
  std::vector<double> out{timed[timed.size() / 2], peak_mib()};
  comm.all_reduce(out, ddp::ReduceOp::max);
  if (comm.rank() == 0) std::printf("ms/step %.3f\npeak MiB %.1f\n", out[0], out[1]);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  bool ok = true;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--ranks")
      a.ranks = std::atoi(v.c_str());
    else if (k == "--width")
      a.width = std::atoi(v.c_str());
    else if (k == "--layers")
      a.layers = std::atoi(v.c_str());
    else if (k == "--batch")
      a.batch = std::atoi(v.c_str());
    else if (k == "--steps")
      a.steps = std::atoi(v.c_str());
    else if (k == "--warmup")
      a.warmup = std::atoi(v.c_str());
    else if (k == "--prefetch" && (v == "on" || v == "off"))
      a.prefetch = v == "on";
    else if (k == "--compute" && (v == "on" || v == "off"))
      a.compute = v == "on";
    else
      ok = false;
  }
  if (!ok || argc % 2 == 0 || a.ranks < 1 || a.width < 1 || a.layers < 1 || a.batch < 1 ||
      a.steps < 1 || a.warmup < 0) {
    std::fprintf(stderr,
                 "usage: fsdp-bench --ranks N [--width W] [--layers L] [--batch B] [--steps S] "
                 "[--warmup K] [--prefetch on|off] [--compute on|off]\n");
    return 2;
  }
  try {
    if (const auto launched = ddp::Environment::detect(); launched.launcher != "none")
      rank_main(a, launched);
    else
      ddp::spawn(a.ranks, [&](ddp::Environment env) { rank_main(a, env); });
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "fsdp-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
