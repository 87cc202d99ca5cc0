// Communicator<backend::Nccl> moves CUDA device memory only: a buffer whose type says it is host
// memory must be rejected when the program is compiled, with a message that says what to use.
#include <ddp/ddp.hpp>

#include <vector>

void step(ddp::Communicator<ddp::backend::Nccl>& comm) {
#ifdef DDP_COMPILE_FAIL
  std::vector<float> grads(16);
  comm.all_reduce(grads);  // error: host memory given to the NCCL backend
#else
  ddp::CudaBuffer<float> grads(16);
  comm.all_reduce(grads);
#endif
}

int main() {}
