// Fully sharded libtorch modules (FSDP2's fully_shard, in C++): a deep MLP of torch::nn::Linear
// layers whose parameters, gradients and Adam's moments are cut into P parts, each rank keeping
// one. ddp::TorchFullyShard makes each layer a unit: the model's forward runs each layer inside
// fsdp.forward(layer, fn), which gathers the layer and points the module's parameters at it;
// autograd's hooks gather it again for its backward and reduce-scatter its gradients into the
// shard as soon as its backward is done. torch::optim::Adam runs on the shard alone.
//
// --averager gradient trains the same model with ddp::GradientAverager (every rank holds
// everything), from the same initial values and data; each rank prints its peak resident memory.
//
//   ./fully_sharded_torch                          (forks 2 ranks; 8 layers of 1024)
//   ./fully_sharded_torch --ranks 4 --layers 16
//   ./fully_sharded_torch --averager gradient
//   ddprun --nproc-per-node 4 ./fully_sharded_torch
#include <ddp/adapters/torch.hpp>
#include <ddp/ddp.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace {

struct Config {
  int ranks = 2, width = 1024, layers = 8, batch = 16, steps = 10;
  bool sharded = true;
};

using Comm = ddp::Communicator<ddp::backend::Host>;
using Fsdp = ddp::TorchFullyShard<ddp::backend::Host>;

struct MlpImpl : torch::nn::Module {
  MlpImpl(int width, int layers) {
    for (int l = 0; l < layers; ++l)
      fc.push_back(register_module("fc" + std::to_string(l), torch::nn::Linear(width, width)));
  }
  // Layer l: tanh after every layer but the last.
  torch::Tensor layer(std::size_t l, const torch::Tensor& x) {
    auto y = fc[l](x);
    return l + 1 < fc.size() ? torch::tanh(y) : y;
  }
  // The whole model, every parameter in place (GradientAverager).
  torch::Tensor forward(torch::Tensor x) {
    for (std::size_t l = 0; l < fc.size(); ++l) x = layer(l, x);
    return x;
  }
  // Fully sharded: each layer inside fsdp.forward, which gathers it (the next on its way).
  torch::Tensor forward(Fsdp& fsdp, torch::Tensor x) {
    for (std::size_t l = 0; l < fc.size(); ++l) x = fsdp.forward(l, [&] { return layer(l, x); });
    return x;
  }
  std::vector<std::shared_ptr<torch::nn::Module>> units() {
    std::vector<std::shared_ptr<torch::nn::Module>> u;
    for (auto& l : fc) u.push_back(l.ptr());
    return u;
  }
  std::vector<torch::nn::Linear> fc;
};
TORCH_MODULE(Mlp);

// Rank r's batch at step s: the same in both modes.
std::pair<torch::Tensor, torch::Tensor> batch(const Config& c, int rank, int step) {
  torch::manual_seed(static_cast<std::uint64_t>(1000 * step + rank));
  auto x = torch::randn({c.batch, c.width});
  return {x, torch::sin(x)};
}

// VmHWM of this process, in KiB.
long peak_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::strtol(line.c_str() + 6, nullptr, 10);
  return 0;
}

void run(ddp::Environment env, const Config& c) {
  auto comm = Comm::init(env);
  torch::set_num_threads(1);
  torch::manual_seed(7);  // rank 0's values are taken by either averager
  Mlp net(c.width, c.layers);
  float loss = 0;
  if (c.sharded) {
    Fsdp fsdp(comm, net->units());
    torch::optim::Adam opt(fsdp.parameters(), torch::optim::AdamOptions(1e-4));
    for (int s = 0; s < c.steps; ++s) {
      const auto [x, y] = batch(c, comm.rank(), s);
      opt.zero_grad();
      auto l = torch::mse_loss(net->forward(fsdp, x), y);
      l.backward();
      fsdp.step(opt);
      loss = l.item<float>();
    }
  } else {
    ddp::GradientAverager avg(comm, *net);
    torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-4));
    for (int s = 0; s < c.steps; ++s) {
      const auto [x, y] = batch(c, comm.rank(), s);
      opt.zero_grad();
      auto l = torch::mse_loss(net->forward(x), y);
      l.backward();
      avg.synchronize();
      opt.step();
      loss = l.item<float>();
    }
  }
  const double mean = ddp::exact_mean(comm, static_cast<double>(loss), 1);
  const auto peaks = comm.all_gather_object(static_cast<std::int64_t>(peak_kib()));
  if (comm.rank() != 0) return;
  const double params = static_cast<double>(c.layers) * c.width * (c.width + 1.0);
  std::printf("%d ranks, %s, %.1fM parameters: mean loss at step %d %.4f\n", comm.size(),
              c.sharded ? "fully sharded (TorchFullyShard)" : "GradientAverager", params / 1e6,
              c.steps, mean);
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
        std::fprintf(stderr, "fully_sharded_torch: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return std::atoi(argv[++i]);
    };
    if (a == "--ranks") {
      c.ranks = value();
    } else if (a == "--width") {
      c.width = value();
    } else if (a == "--layers") {
      c.layers = value();
    } else if (a == "--batch") {
      c.batch = value();
    } else if (a == "--steps") {
      c.steps = value();
    } else if (a == "--averager" && i + 1 < argc &&
               (std::string(argv[i + 1]) == "gradient" ||
                std::string(argv[i + 1]) == "fully_sharded")) {
      c.sharded = std::string(argv[++i]) == "fully_sharded";
    } else {
      std::fprintf(stderr,
                   "usage: fully_sharded_torch [--ranks N] [--width D] [--layers L] [--batch B] "
                   "[--steps S] [--averager fully_sharded|gradient]\n");
      return a == "-h" || a == "--help" ? 0 : 2;
    }
  }
  if (c.ranks < 1 || c.width < 1 || c.layers < 1 || c.batch < 1 || c.steps < 1) {
    std::fprintf(stderr, "fully_sharded_torch: every number must be at least 1\n");
    return 2;
  }
  try {
    const auto env = ddp::Environment::detect();
    if (env.launcher == "none")
      ddp::spawn(c.ranks, [&](ddp::Environment e) { run(e, c); });
    else
      run(env, c);
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "fully_sharded_torch: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fully_sharded_torch: %s\n", e.what());
    return 1;
  }
}
