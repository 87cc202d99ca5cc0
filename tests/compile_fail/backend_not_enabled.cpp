// backend::Nccl / backend::Mpi used in a translation unit built without them: the first error
// says what to link or define, not "Nccl is not a member of ddp::backend".
#include <ddp/ddp.hpp>

int main() {
#ifdef DDP_COMPILE_FAIL
#if CASE == 1
  auto comm = ddp::Communicator<ddp::backend::Nccl>::init();
#else
  auto comm = ddp::Communicator<ddp::backend::Mpi>::init();
#endif
#else
  auto comm = ddp::Communicator<ddp::backend::Host>::init();
#endif
  return comm.rank();
}
