// libtorch tensors a collective cannot take as written: a torch::Tensor without ddp's adapter
// (the error names the header), and a std::vector<torch::Tensor> where a collective takes one
// tensor (the error names all_reduce_coalesced). Built once per CASE.
#include <ddp/ddp.hpp>
#if !defined(DDP_COMPILE_FAIL) || CASE != 1
#include <ddp/adapters/torch.hpp>
#endif

#include <torch/torch.h>

#include <vector>

int main() {
  auto comm = ddp::Communicator<ddp::backend::Host>::init();
  torch::Tensor t = torch::ones({4});
  std::vector<torch::Tensor> grads{torch::ones({4}), torch::ones({2})};
#if defined(DDP_COMPILE_FAIL) && CASE == 1
  comm.all_reduce(t);
#elif defined(DDP_COMPILE_FAIL) && CASE == 2
  comm.all_reduce_async(grads).wait();
#else
  comm.all_reduce(t);
  comm.all_reduce_coalesced_async(grads).wait();
#endif
}
