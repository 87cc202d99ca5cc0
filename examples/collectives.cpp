// PyTorch's "Writing Distributed Applications" tutorial's run.py: a process group and every kind of
// communication, in C++.
//   build/default/examples/collectives             (forks 4 ranks)
//   ddprun --standalone --nproc-per-node 4 build/default/examples/collectives
#include <ddp/ddp.hpp>

#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

void run(ddp::Environment env) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);  // init_process_group
  const int rank = comm.rank(), size = comm.size();
  std::string out = "rank " + std::to_string(rank) + ":";
  const auto note = [&](const char* what, float v) {
    out += std::string(" ") + what + "=" + std::to_string(static_cast<int>(v));
  };

  // Point to point: rank 0 sends to rank 1 (blocking), rank 1 answers (non-blocking).
  std::vector<float> t{0};
  if (rank == 0) {
    t[0] = 42;
    comm.send(t, 1);
    comm.recv_async(t, 1).wait();
    note("p2p", t[0]);
  } else if (rank == 1) {
    comm.recv(t, 0);
    t[0] += 1;
    comm.send_async(t, 0).wait();
  }

  std::vector<float> x{static_cast<float>(rank + 1)};
  comm.all_reduce(x);  // 1 + 2 + ... + size on every rank
  note("all_reduce", x[0]);

  std::vector<float> y{static_cast<float>(rank + 1)};
  comm.reduce(y, /*root=*/0, ddp::ReduceOp::max);  // only rank 0's buffer changes
  if (rank == 0) note("reduce_max", y[0]);

  std::vector<float> b{rank == 0 ? 7.0f : 0.0f};
  comm.broadcast(b, 0);
  note("broadcast", b[0]);

  std::vector<float> pieces(static_cast<std::size_t>(size));
  std::iota(pieces.begin(), pieces.end(), 10.0f);  // only rank 0's are sent
  std::vector<float> mine(1);
  comm.scatter(pieces, mine, 0);  // rank r gets 10 + r
  note("scatter", mine[0]);

  std::vector<float> all(static_cast<std::size_t>(size));
  comm.all_gather(mine, all);  // everyone gets 10, 11, ...
  note("all_gather_last", all.back());

  std::vector<float> gathered(static_cast<std::size_t>(size));
  comm.gather(mine, gathered, 0);
  if (rank == 0) note("gather_sum", std::accumulate(gathered.begin(), gathered.end(), 0.0f));

  comm.barrier();
  // One line per rank, in rank order.
  const auto lines = comm.gather_object(out, 0);
  if (rank == 0)
    for (const auto& l : lines) std::printf("%s\n", l.c_str());
}

int main() {
  const auto env = ddp::Environment::detect();
  if (env.launcher == "none")
    ddp::spawn(4, run);
  else
    run(env);
}
