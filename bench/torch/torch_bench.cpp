// torch-bench: a libtorch training step with ddp, against the same step in one process.
//   torch-bench --model mlp|cnn --ranks N --mode hooks|average|none [--steps S] [--warmup W]
// hooks: GradientAverager with autograd hooks (buckets start during backward); average: the
// averager's average() after backward; none: one process, no communication (--ranks ignored).
// N ranks are forked on this machine (ddp::spawn, backend::Host over shared memory); each trains
// on its own synthetic batch of 64 (the model and batch of bench/torch/torch_ddp.py, PyTorch
// DDP's side). Prints "ms/step X" (the slowest rank's mean over the timed steps).
#include <ddp/adapters/torch.hpp>
#include <ddp/ddp.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../examples/torch/models.hpp"

namespace {

using torch_models::Cnn;
using torch_models::Mlp;

struct Args {
  std::string model = "mlp", mode = "hooks";
  int ranks = 2, steps = 30, warmup = 5;
};

template <class Net>
double run(const Args& a, ddp::Communicator<ddp::backend::Host>* comm) {
  torch::set_num_threads(1);
  torch::manual_seed(1);
  Net net;
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
  const int rank = comm != nullptr ? comm->rank() : 0;
  torch::manual_seed(static_cast<std::uint64_t>(100 + rank));
  const auto x = torch::randn({64, 1, 28, 28});
  const auto y = torch::randint(0, 10, {64}, torch::kLong);
  std::unique_ptr<ddp::GradientAverager<typename Net::Impl, ddp::backend::Host>> avg;
  if (comm != nullptr)
    avg = std::make_unique<ddp::GradientAverager<typename Net::Impl, ddp::backend::Host>>(
        *comm, *net, ddp::AveragerOptions{.hooks = a.mode == "hooks"});
  const auto step = [&] {
    opt.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    if (avg) {
      if (a.mode == "hooks")
        avg->synchronize();
      else
        avg->average();
    }
    opt.step();
  };
  for (int i = 0; i < a.warmup; ++i) step();
  if (comm != nullptr) comm->barrier();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.steps; ++i) step();
  double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
      a.steps;
  if (comm != nullptr) {
    std::vector<double> v{ms};
    comm->all_reduce(v, ddp::ReduceOp::max);
    ms = v[0];
  }
  return ms;
}

double run_model(const Args& a, ddp::Communicator<ddp::backend::Host>* comm) {
  return a.model == "cnn" ? run<Cnn>(a, comm) : run<Mlp>(a, comm);
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
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
    else {
      std::fprintf(stderr,
                   "usage: torch-bench --model mlp|cnn --ranks N --mode hooks|average|none "
                   "[--steps S] [--warmup W]\n");
      return 2;
    }
  }
  if ((a.model != "mlp" && a.model != "cnn") ||
      (a.mode != "hooks" && a.mode != "average" && a.mode != "none") || a.ranks < 1 ||
      a.steps < 1) {
    std::fprintf(stderr, "torch-bench: bad arguments\n");
    return 2;
  }
  try {
    if (a.mode == "none") {
      std::printf("%s none 1 rank: ms/step %.3f\n", a.model.c_str(), run_model(a, nullptr));
      return 0;
    }
    ddp::spawn(a.ranks, [&](ddp::Environment env) {
      auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
      const double ms = run_model(a, &comm);
      if (comm.rank() == 0)
        std::printf("%s %s %d ranks: ms/step %.3f\n", a.model.c_str(), a.mode.c_str(), comm.size(),
                    ms);
    });
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "torch-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
