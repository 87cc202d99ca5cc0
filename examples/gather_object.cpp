// A gather_object helper as torch.distributed has it: collect any value (here a struct and a string
// per rank) on one rank. Values travel through a typed codec: nothing from the wire is executed,
// and malformed or oversized input is refused with an error.
#include <ddp/ddp.hpp>

#include <cstdio>
#include <string>
#include <vector>

struct Metrics {  // trivially copyable: sent as bytes, checked for size
  int rank;
  float loss;
  long samples;
};

void run(ddp::Environment env) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
  const Metrics m{comm.rank(), 1.0f / static_cast<float>(comm.rank() + 1),
                  1000L * (comm.rank() + 1)};
  const std::vector<Metrics> all = comm.gather_object(m, /*root=*/0);  // empty on other ranks
  const auto hosts = comm.all_gather_object(std::string("worker-") + std::to_string(comm.rank()));
  if (comm.rank() == 0) {
    long total = 0;
    for (const auto& x : all) {
      std::printf("rank %d (%s): loss %.3f over %ld samples\n", x.rank,
                  hosts[static_cast<std::size_t>(x.rank)].c_str(), x.loss, x.samples);
      total += x.samples;
    }
    std::printf("%zu ranks, %ld samples\n", all.size(), total);
  }
}

int main() {
  const auto env = ddp::Environment::detect();
  if (env.launcher == "none")
    ddp::spawn(3, run);
  else
    run(env);
}
