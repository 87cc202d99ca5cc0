#include <ddp/ddp.hpp>

#include <cstdio>
#include <string>
#include <vector>

void train(ddp::Environment env) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
  std::vector<float> grad(1 << 20, float(comm.rank()));  // this rank's gradient
  comm.all_reduce(grad, ddp::ReduceOp::avg);             // now the mean on every rank
  auto who = comm.gather_object("rank " + std::to_string(comm.rank()), /*root=*/0);
  if (comm.rank() == 0) {
    std::printf("%zu ranks over %s: mean %.2f, last is %s\n", who.size(),
                std::string(comm.backend().transport()).c_str(), grad[0], who.back().c_str());
  }
}

int main() {
  const auto env = ddp::Environment::detect();  // torchrun, srun, mpirun, ... or none
  if (env.launcher == "none")
    ddp::spawn(4, train);  // no launcher: fork 4 ranks here
  else
    train(env);
}
