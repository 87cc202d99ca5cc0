// reducer-bench: libtorch's own C++ DDP engine, c10d::Reducer over c10d::ProcessGroupGloo, on the
// training step torch-bench measures with ddp (the same models, batch, optimizer and threads):
// what a libtorch user who writes DDP in C++ today would run.
//   reducer-bench --model cnn|mnist-net|mlp --ranks N [--steps S] [--warmup W] [--hidden H]
// The call sequence is Python DistributedDataParallel's (torch 1.13): the parameters broadcast
// from rank 0 (broadcast_coalesced), buckets assigned by compute_bucket_assignment_by_size
// (1 MiB first bucket, 25 MiB the others) and given to the Reducer in reverse, then each step
// rebuild_buckets() and prepare_for_forward() before the forward pass and
// prepare_for_backward({}) after it; backward runs the Reducer's autograd hooks, which
// all_reduce the buckets and average the gradients before backward returns. Forks --ranks
// ranks itself (ddp::spawn only starts the processes: the store is c10d's FileStore). Prints
// "ms/step X" (the slowest rank's mean over the timed steps).
#include <ddp/spawn.hpp>

#include <unistd.h>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../../examples/torch/models.hpp"

namespace {

struct Args {
  std::string model = "cnn";
  int ranks = 2, steps = 30, warmup = 5, hidden = 2048;
};

constexpr std::int64_t batch = 64;

template <class Net>
double run(const Args& a, Net net, const ddp::Environment& env) {
  torch::set_num_threads(1);
  // A FileStore: ddp::spawn's parent serves its own store on MASTER_PORT.
  const std::string path = "/tmp/reducer-bench-" + std::to_string(::getppid());
  auto store = c10::make_intrusive<c10d::FileStore>(path, env.world_size);
  auto options = c10d::ProcessGroupGloo::Options::create();
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, options);

  std::vector<at::Tensor> params;
  for (auto& p : net->parameters()) params.push_back(p);
  {
    torch::NoGradGuard no_grad;  // as DDP's _sync_module_states
    c10d::broadcast_coalesced(pg, params, 250 * 1024 * 1024, 0);
  }
  const std::vector<bool> sparse(params.size(), false);
  constexpr std::int64_t first_cap = 1024 * 1024, cap = 25 * 1024 * 1024;
  auto [indices, limits] = c10d::compute_bucket_assignment_by_size(
      params, {static_cast<std::size_t>(first_cap), static_cast<std::size_t>(cap)}, sparse, {},
      c10::nullopt);
  std::reverse(indices.begin(), indices.end());
  std::reverse(limits.begin(), limits.end());
  c10d::Reducer reducer(params, indices, limits, pg, sparse, cap, /*find_unused_parameters=*/false,
                        /*gradient_as_bucket_view=*/false, {}, first_cap);

  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.01));
  torch::manual_seed(static_cast<std::uint64_t>(100 + env.rank));
  const auto x = torch::randn({batch, 1, 28, 28});
  const auto y = torch::randint(0, 10, {batch}, torch::kLong);
  const auto step = [&] {
    opt.zero_grad();
    (void)reducer.rebuild_buckets();  // the first step only (as DDP.forward)
    reducer.prepare_for_forward();
    auto out = net->forward(x);
    reducer.prepare_for_backward({});
    torch::nn::functional::cross_entropy(out, y).backward();  // buckets averaged in here
    opt.step();
  };
  for (int i = 0; i < a.warmup; ++i) step();
  pg->barrier()->wait();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.steps; ++i) step();
  auto ms = torch::tensor(
      {std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
       a.steps},
      torch::kFloat64);
  std::vector<at::Tensor> v{ms};
  c10d::AllreduceOptions max;
  max.reduceOp = c10d::ReduceOp::MAX;
  pg->allreduce(v, max)->wait();
  pg->barrier()->wait();
  if (env.rank == 0) std::remove(path.c_str());
  return ms.item<double>();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model")
      a.model = v;
    else if (k == "--ranks")
      a.ranks = std::atoi(v.c_str());
    else if (k == "--steps")
      a.steps = std::atoi(v.c_str());
    else if (k == "--warmup")
      a.warmup = std::atoi(v.c_str());
    else if (k == "--hidden")
      a.hidden = std::atoi(v.c_str());
    else
      a.ranks = 0;
  }
  if ((a.model != "cnn" && a.model != "mnist-net" && a.model != "mlp") || a.ranks < 1 ||
      a.steps < 1 || a.warmup < 0 || a.hidden < 1 || argc % 2 == 0) {
    std::fprintf(
        stderr,
        "usage: reducer-bench --model cnn|mnist-net|mlp --ranks N [--steps S] [--warmup W] "
        "[--hidden H]\n");
    return 2;
  }
  try {
    ddp::spawn(a.ranks, [&](ddp::Environment env) {
      const double ms = a.model == "mlp"         ? run(a, torch_models::Mlp(a.hidden), env)
                        : a.model == "mnist-net" ? run(a, torch_models::MnistNet(), env)
                                                 : run(a, torch_models::Cnn(), env);
      if (env.rank == 0)
        std::printf("%s reducer %d ranks: ms/step %.3f\n", a.model.c_str(), env.world_size, ms);
    });
  } catch (const std::exception& e) {
    std::fprintf(stderr, "reducer-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
