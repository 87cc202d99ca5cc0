// TorchFullyShard over CUDA modules (a libtorch with CUDA: tests/cuda/torch/CMakeLists.txt, run
// by scripts/gpu.sh): units gathered on the GPU, the shard there or offloaded to the host, the
// modules' parameters swapped to device memory at each gather; trained as plain torch trains the
// same module. A world of one over backend::Host (CUDA buffers staged); the multi-rank logic is
// the CPU suite's, the device engine's across processes the staging suite's. Without a CUDA
// device it prints "no CUDA device" and exits 0.
#define DOCTEST_CONFIG_IMPLEMENT
#include <ddp/adapters/torch.hpp>
#include <ddp/ddp.hpp>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(16, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 4))) {}
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

Net make(const at::Device& d) {
  torch::manual_seed(7);
  Net n;
  n->to(d);
  return n;
}

}  // namespace

TEST_CASE("TorchFullyShard over CUDA modules: units on the GPU, the shard there or offloaded") {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(ddp::Environment{});
  const at::Device d(at::kCUDA, 0);
  for (const bool offload : {false, true}) {
    CAPTURE(offload);
    Net ref = make(d), net = make(d);
    torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    ddp::TorchFullyShardOptions o;
    o.offload = offload;
    ddp::TorchFullyShard fsdp(comm, {net->fc1.ptr(), net->fc2.ptr()}, o);
    CHECK(fsdp.averager().device() == ddp::Device::cuda(0));
    CHECK(fsdp.parameters()[0].device() == (offload ? at::Device(at::kCPU) : d));
    CHECK(net->fc1->weight.numel() == 0);  // released: the shard holds it
    torch::optim::SGD opt(fsdp.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 3; ++step) {
      torch::manual_seed(100 + step);
      const auto x = torch::randn({8, 16}, torch::TensorOptions().device(d));
      ref_opt.zero_grad();
      ref->fc2(torch::tanh(ref->fc1(x))).pow(2).mean().backward();
      ref_opt.step();
      opt.zero_grad();
      auto h = fsdp.forward(0, [&] {
        CHECK(net->fc1->weight.device() == d);
        return net->fc1(x);
      });
      auto y = fsdp.forward(1, [&] { return net->fc2(torch::tanh(h)); });
      y.pow(2).mean().backward();
      fsdp.step(opt);
    }
    std::vector<float> got, want;
    fsdp.averager().gather_to(0, [&](std::size_t, std::size_t, std::span<const float> v) {
      got.insert(got.end(), v.begin(), v.end());
    });
    for (const auto& p : ref->parameters()) {
      const auto c = p.detach().to(at::kCPU).contiguous();
      want.insert(want.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
    }
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      REQUIRE(std::abs(got[i] - want[i]) <= 1e-5f * (1.0f + std::abs(want[i])));
  }
}

int main(int argc, char** argv) {
  if (!torch::cuda::is_available()) {
    std::puts("ddp CUDA torch tests: no CUDA device; skipped");
    return 0;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
