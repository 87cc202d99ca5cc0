// torch-bench: a libtorch training step with ddp, against the same step in one process.
//   torch-bench --model mlp|cnn|mnist-net|device-mlp --ranks N --mode
//   hooks|average|local|barrier|comm|none
//               [--steps S] [--warmup W] [--phases]
// Modes:
//   hooks    GradientAverager with autograd hooks: buckets start during backward
//   average  the averager's average() after backward
//   local    N ranks that each train alone, without communication (what the ranks' compute costs
//            when they share the machine)
//   barrier  as local, with a barrier after backward (what keeping the ranks in step costs, without
//            moving data: the wait for the slowest rank's compute, each step)
//   comm     the averager's average() alone, on gradients made once (the communication floor of
//            this model's gradients at this minute)
//   none     one process, no communication (--ranks ignored)
// Models: mlp (784-2048-2048-10, 25 MB of gradients) and cnn (examples/torch/models.hpp, the
// models of bench/torch/torch_ddp.py, PyTorch DDP's side); mnist-net: pytorch/examples' C++
// MNIST network (22 k parameters, a short step); device-mlp: the MLP's parameters, with
// each layer's forward and backward a wait as long as that layer's matrix products take on this
// CPU (measured at start) -- an accelerator as its host thread sees it, leaving the CPU free while
// it "computes" -- and gradients that stay allocated across steps, as device memory would. It has
// no optimizer step. It shows what overlap gains where a core is free for communication.
// N ranks are forked on this machine (ddp::spawn, backend::Host over shared memory); each trains
// on its own synthetic batch of 64. Prints "ms/step X" (the slowest rank's mean over the timed
// steps); --phases also prints each rank's time per phase of the step.
#include <ddp/adapters/torch.hpp>
#include <ddp/ddp.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../../examples/torch/models.hpp"

namespace {

using torch_models::Cnn;
using torch_models::Mlp;
using clock_type = std::chrono::steady_clock;

struct Args {
  std::string model = "mlp", mode = "hooks", hook = "fp32";
  int ranks = 2, steps = 30, warmup = 5, psgd_rank = 4, hidden = 2048;
  bool phases = false;
};

double ms_since(clock_type::time_point t) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t).count();
}

void wait_ms(double ms) {
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(ms));
}

// ---- device-mlp ----

// What one layer of the accelerator-style MLP costs: its forward and backward times, and the
// gradients its backward hands autograd (kept across steps).
struct WaitLayer {
  double forward_ms = 0, backward_ms = 0;
  torch::Tensor grad_input, grad_weight, grad_bias;
};

struct WaitLinearFn : torch::autograd::Function<WaitLinearFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w, const torch::Tensor& /*b*/,
                               WaitLayer* layer) {
    wait_ms(layer->forward_ms);
    ctx->saved_data["layer"] = reinterpret_cast<std::int64_t>(layer);
    return torch::zeros({x.size(0), w.size(0)});
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list&) {
    auto* layer = reinterpret_cast<WaitLayer*>(ctx->saved_data["layer"].toInt());
    wait_ms(layer->backward_ms);
    // detach(): a new handle on the same storage, which autograd then takes as the gradient
    // without copying it (the gradients are set to None before each step).
    return {layer->grad_input.detach(), layer->grad_weight.detach(), layer->grad_bias.detach(),
            torch::Tensor()};
  }
};

struct WaitLinearImpl : torch::nn::Module {
  WaitLinearImpl(int64_t in, int64_t out, int64_t batch, double forward_ms, double backward_ms)
      : weight(register_parameter("weight", torch::randn({out, in}) * 0.01)),
        bias(register_parameter("bias", torch::zeros({out}))) {
    layer.forward_ms = forward_ms;
    layer.backward_ms = backward_ms;
    layer.grad_input = torch::full({batch, in}, 1e-3F);
    layer.grad_weight = torch::full({out, in}, 1e-3F);
    layer.grad_bias = torch::full({out}, 1e-3F);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return WaitLinearFn::apply(x, weight, bias, &layer);
  }
  torch::Tensor weight, bias;
  WaitLayer layer;
};
TORCH_MODULE(WaitLinear);

constexpr std::array<std::array<int64_t, 2>, 3> mlp_layers{{{784, 2048}, {2048, 2048}, {2048, 10}}};
constexpr int64_t batch = 64;

// The MLP's layer times on this CPU: forward x W^T + b; backward dW = g^T x, db = sum g, and
// dx = g W except for the first layer (its input needs no gradient). Median of 7.
std::array<std::array<double, 2>, 3> measure_layers() {
  torch::set_num_threads(1);
  std::array<std::array<double, 2>, 3> t{};
  for (std::size_t l = 0; l < mlp_layers.size(); ++l) {
    const auto [in, out] = mlp_layers[l];
    const auto x = torch::randn({batch, in}), w = torch::randn({out, in}), b = torch::randn({out});
    const auto g = torch::randn({batch, out});
    std::vector<double> f, bw;
    for (int r = 0; r < 8; ++r) {
      auto t0 = clock_type::now();
      auto y = torch::addmm(b, x, w.t());
      f.push_back(ms_since(t0));
      t0 = clock_type::now();
      auto dw = g.t().mm(x);
      auto db = g.sum(0);
      if (l > 0) auto dx = g.mm(w);
      bw.push_back(ms_since(t0));
    }
    f.erase(f.begin());  // the first is a warm-up
    bw.erase(bw.begin());
    std::nth_element(f.begin(), f.begin() + 3, f.end());
    std::nth_element(bw.begin(), bw.begin() + 3, bw.end());
    t[l] = {f[3], bw[3]};
  }
  return t;
}

struct DeviceMlpImpl : torch::nn::Module {
  explicit DeviceMlpImpl(const std::array<std::array<double, 2>, 3>& t)
      : fc1(register_module("fc1", WaitLinear(784, 2048, batch, t[0][0], t[0][1]))),
        fc2(register_module("fc2", WaitLinear(2048, 2048, batch, t[1][0], t[1][1]))),
        fc3(register_module("fc3", WaitLinear(2048, 10, batch, t[2][0], t[2][1]))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc3(fc2(fc1(x.view({x.size(0), 784})))); }
  WaitLinear fc1, fc2, fc3;
};
TORCH_MODULE(DeviceMlp);

// ---- the step ----

template <class Net>
double run(const Args& a, Net net, ddp::Communicator<ddp::backend::Host>* comm) {
  using Averager = ddp::GradientAverager<typename Net::Impl, ddp::backend::Host>;
  constexpr bool device = std::is_same_v<Net, DeviceMlp>;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
  const int rank = comm != nullptr ? comm->rank() : 0;
  torch::manual_seed(static_cast<std::uint64_t>(100 + rank));
  const auto x = torch::randn({batch, 1, 28, 28});
  const auto y = torch::randint(0, 10, {batch}, torch::kLong);
  std::unique_ptr<Averager> avg;
  if (comm != nullptr && a.mode != "local" && a.mode != "barrier")
    avg = std::make_unique<Averager>(*comm, *net, ddp::BucketOptions{.hooks = a.mode == "hooks"});
  // --hook powersgd: compressed from the first step (its steady state is what is timed).
  ddp::PowerSGDHook powersgd({.rank = static_cast<std::size_t>(a.psgd_rank), .start_iter = 0});
  if (avg && a.hook == "powersgd") avg->register_comm_hook(powersgd);
  if (avg && a.hook == "bf16") avg->register_comm_hook(ddp::bf16_compress_hook);
  std::array<double, 4> phase{};  // forward, backward, average/synchronize, optimizer (ms, summed)
  bool timing = false;
  const auto lap = [&](clock_type::time_point& t, std::size_t i) {
    if (timing) phase[i] += ms_since(t);
    t = clock_type::now();
  };
  const auto compute = [&](clock_type::time_point& t) {
    if constexpr (device) {
      for (auto& p : net->parameters()) p.mutable_grad().reset();
    } else {
      opt.zero_grad();
    }
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    lap(t, 0);
    loss.backward();
    lap(t, 1);
  };
  const auto step = [&] {
    auto t = clock_type::now();
    if (a.mode != "comm") compute(t);
    if (a.mode == "barrier") comm->barrier();
    if (avg) {
      if (a.mode == "hooks")
        avg->synchronize();
      else
        avg->average();
    }
    lap(t, 2);
    if (!device && a.mode != "comm") opt.step();
    lap(t, 3);
  };
  if (a.mode == "comm") {  // gradients to average, made once
    auto t = clock_type::now();
    compute(t);
  }
  for (int i = 0; i < a.warmup; ++i) step();
  if (comm != nullptr) comm->barrier();
  timing = true;
  const auto t0 = clock_type::now();
  for (int i = 0; i < a.steps; ++i) step();
  double ms = ms_since(t0) / a.steps;
  if (a.phases)
    std::fprintf(stderr, "rank %d: forward %.2f backward %.2f %s %.2f optimizer %.2f (ms/step)\n",
                 rank, phase[0] / a.steps, phase[1] / a.steps,
                 a.mode == "hooks" ? "synchronize" : "average", phase[2] / a.steps,
                 phase[3] / a.steps);
  if (comm != nullptr) {
    std::vector<double> v{ms};
    comm->all_reduce(v, ddp::ReduceOp::max);
    ms = v[0];
  }
  if (comm != nullptr && comm->rank() == 0 && avg) {  // bytes each rank all_reduces per step
    const auto st = powersgd.stats();
    double full = 0;
    for (const auto& p : net->parameters()) full += static_cast<double>(p.numel());
    const double sent = a.hook == "powersgd"
                            ? static_cast<double>(st.sent) / static_cast<double>(st.steps)
                            : full * (a.hook == "bf16" ? 0.5 : 1.0);
    std::printf("wire: %.3f MB per step all_reduced by each rank (fp32 %.3f MB, 1/%.1f)\n",
                sent * 4e-6, full * 4e-6, full / sent);
  }
  return ms;
}

double run_model(const Args& a, const std::array<std::array<double, 2>, 3>& layer_ms,
                 ddp::Communicator<ddp::backend::Host>* comm) {
  torch::set_num_threads(1);
  torch::manual_seed(1);
  if (a.model == "cnn") return run(a, Cnn(), comm);
  if (a.model == "mnist-net") return run(a, torch_models::MnistNet(), comm);
  if (a.model == "device-mlp") return run(a, DeviceMlp(layer_ms), comm);
  return run(a, Mlp(a.hidden), comm);
}

bool one_of(const std::string& s, std::initializer_list<const char*> options) {
  return std::any_of(options.begin(), options.end(), [&](const char* o) { return s == o; });
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--phases") {
      a.phases = true;
      --i;
      continue;
    }
    const std::string v = i + 1 < argc ? argv[i + 1] : "";
    if (k == "--model")
      a.model = v;
    else if (k == "--mode")
      a.mode = v;
    else if (k == "--ranks")
      a.ranks = std::atoi(v.c_str());
    else if (k == "--steps")
      a.steps = std::atoi(v.c_str());
    else if (k == "--warmup")
      a.warmup = std::atoi(v.c_str());
    else if (k == "--hook")
      a.hook = v;
    else if (k == "--psgd-rank")
      a.psgd_rank = std::atoi(v.c_str());
    else if (k == "--hidden")
      a.hidden = std::atoi(v.c_str());
    else
      a.ranks = 0;  // unknown: the usage below
  }
  if (!one_of(a.model, {"mlp", "cnn", "mnist-net", "device-mlp"}) ||
      !one_of(a.mode, {"hooks", "average", "local", "barrier", "comm", "none"}) || a.ranks < 1 ||
      !one_of(a.hook, {"fp32", "bf16", "powersgd"}) || a.psgd_rank < 1 || a.hidden < 1 ||
      a.steps < 1 || a.warmup < 0) {
    std::fprintf(
        stderr,
        "usage: torch-bench --model mlp|cnn|mnist-net|device-mlp --ranks N "
        "--mode hooks|average|local|barrier|comm|none [--steps S] [--warmup W] [--phases]\n"
        "  [--hook fp32|bf16|powersgd] [--psgd-rank R] [--hidden H (the MLP's width)]\n");
    return 2;
  }
  const auto layer_ms =
      a.model == "device-mlp" ? measure_layers() : std::array<std::array<double, 2>, 3>{};
  if (a.model == "device-mlp" && a.phases)
    std::fprintf(stderr,
                 "device-mlp layer times (forward/backward ms): %.2f/%.2f %.2f/%.2f %.2f/%.2f\n",
                 layer_ms[0][0], layer_ms[0][1], layer_ms[1][0], layer_ms[1][1], layer_ms[2][0],
                 layer_ms[2][1]);
  try {
    if (a.mode == "none") {
      std::printf("%s none 1 rank: ms/step %.3f\n", a.model.c_str(),
                  run_model(a, layer_ms, nullptr));
      return 0;
    }
    const auto rank_main = [&](const ddp::Environment& env) {
      auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
      const double ms = run_model(a, layer_ms, &comm);
      if (comm.rank() == 0)
        std::printf("%s %s %d ranks: ms/step %.3f\n", a.model.c_str(), a.mode.c_str(), comm.size(),
                    ms);
    };
    // Under a launcher (ddprun, torchrun, or ranks started by hand in two network namespaces):
    // this process is one rank; otherwise it forks --ranks of them.
    if (const auto launched = ddp::Environment::detect(); launched.launcher != "none")
      rank_main(launched);
    else
      ddp::spawn(a.ranks, [&](ddp::Environment env) { rank_main(env); });
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "torch-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
