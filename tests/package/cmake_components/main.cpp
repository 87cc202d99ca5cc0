// Links against each requested component's library and checks the backend macros it sets.
#include <ddp/ddp.hpp>

#include <cstdio>

#if defined(DDP_EXPECT_MPI)
#include <mpi.h>
static_assert(DDP_HAS_MPI == 1, "ddp::mpi must define DDP_HAS_MPI=1");
#endif
#if defined(DDP_EXPECT_NCCL)
#include <nccl.h>
static_assert(DDP_HAS_NCCL == 1 && DDP_HAS_CUDA == 1, "ddp::nccl must define DDP_HAS_NCCL/CUDA=1");
#endif

int main() {
#if defined(DDP_EXPECT_MPI)
  int initialized = -1;
  MPI_Initialized(&initialized);  // callable before MPI_Init: proves the link, needs no launcher
  std::printf("mpi linked (initialized=%d)\n", initialized);
#endif
#if defined(DDP_EXPECT_NCCL)
  int version = 0;
  ncclGetVersion(&version);  // needs no GPU
  std::printf("nccl linked (%d)\n", version);
#endif
  std::printf("components ok: ddp %.*s\n", int(ddp::version().size()), ddp::version().data());
  return 0;
}
