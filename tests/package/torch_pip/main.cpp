// ddp with pip's libtorch: a collective on torch tensors and a GradientAverager with hooks,
// two ranks forked by ddp::spawn. Prints one line that tests/package/torch_pip.sh checks.
#include <ddp/adapters/torch.hpp>
#include <ddp/ddp.hpp>

#include <torch/torch.h>
#include <torch/version.h>

#include <cstdio>
#include <stdexcept>
#include <string>

int main() {
  ddp::spawn(2, [](ddp::Environment env) {
    auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
    torch::set_num_threads(1);
    auto t = torch::full({3}, comm.rank() + 1.0);  // float32: 1 on rank 0, 2 on rank 1
    comm.all_reduce(t);
    auto d = torch::full({2}, comm.rank() + 1, torch::kInt64);
    comm.all_reduce(d, ddp::ReduceOp::max);
    torch::manual_seed(static_cast<std::uint64_t>(comm.rank()));
    torch::nn::Linear net(4, 2);
    ddp::GradientAverager avg(comm, *net);  // rank 0's parameters, hooks on
    net->forward(torch::ones({1, 4}) * (comm.rank() + 1)).sum().backward();
    avg.synchronize();
    // d(sum)/dW = the input: 1 on rank 0, 2 on rank 1; their average 1.5.
    const bool ok = torch::all(t == 3).item<bool>() && torch::all(d == 2).item<bool>() &&
                    torch::allclose(net->weight.grad(), torch::full({2, 4}, 1.5F));
    if (!ok) throw std::runtime_error("rank " + std::to_string(comm.rank()) + ": wrong result");
    if (comm.rank() == 0)
      std::printf("libtorch %d.%d with ddp %s: all_reduce and GradientAverager ok\n",
                  TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, DDP_VERSION_STRING);
  });
}
