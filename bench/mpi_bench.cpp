// mpi-bench: the same measurements as ddp-bench, with the MPI library's collectives (the peer
// ddp is compared against). Run it with mpirun, e.g.
//   mpirun -np 2 --allow-run-as-root --oversubscribe build/bench/mpi-bench --csv mpi.csv
// With --via ddp it makes the same calls through ddp::Communicator<ddp::backend::Mpi>; with
// --via both it alternates raw MPI and ddp at each size (best of --rounds each) and prints the
// overhead ddp adds.
#include <mpi.h>
#include <ddp/ddp.hpp>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <optional>
#include <span>
#include <vector>

#include "bench_common.hpp"

namespace {

double time_op(const std::string& op, float* a, float* b, int count, int iterations, int p) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iterations; ++i) {
    if (op == "all_reduce")
      MPI_Allreduce(MPI_IN_PLACE, a, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (op == "broadcast")
      MPI_Bcast(a, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
    else if (op == "reduce") {
      int rank;
      MPI_Comm_rank(MPI_COMM_WORLD, &rank);
      MPI_Reduce(rank == 0 ? MPI_IN_PLACE : a, a, count, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
    } else if (op == "all_gather")
      MPI_Allgather(MPI_IN_PLACE, 0, MPI_FLOAT, a, count / p, MPI_FLOAT, MPI_COMM_WORLD);
    else if (op == "reduce_scatter")
      MPI_Reduce_scatter_block(a, b, count / p, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    else if (op == "all_to_all")
      MPI_Alltoall(a, count / p, MPI_FLOAT, b, count / p, MPI_FLOAT, MPI_COMM_WORLD);
    else if (op == "barrier")
      MPI_Barrier(MPI_COMM_WORLD);
    else
      throw std::invalid_argument("unknown collective " + op);
  }
  double mine = (MPI_Wtime() - t0) * 1e6 / iterations, slowest = 0;
  MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

using DdpMpi = ddp::Communicator<ddp::backend::Mpi>;

/// time_op's calls, made through ddp's Communicator on the same buffers.
double time_ddp(DdpMpi& comm, const std::string& op, float* a, float* b, int count, int iterations,
                int p) {
  const auto n = static_cast<std::size_t>(count), block = n / static_cast<std::size_t>(p);
  const std::span<float> A(a, n), B(b, n);
  const auto mine = A.subspan(block * static_cast<std::size_t>(comm.rank()), block);
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iterations; ++i) {
    if (op == "all_reduce")
      comm.all_reduce(A);
    else if (op == "broadcast")
      comm.broadcast(A, 0);
    else if (op == "reduce")
      comm.reduce(A, 0);
    else if (op == "all_gather")
      comm.all_gather(mine, A.first(block * static_cast<std::size_t>(p)));
    else if (op == "reduce_scatter")
      comm.reduce_scatter(A.first(block * static_cast<std::size_t>(p)), B.first(block));
    else if (op == "all_to_all")
      comm.all_to_all(A.first(block * static_cast<std::size_t>(p)),
                      B.first(block * static_cast<std::size_t>(p)));
    else if (op == "barrier")
      comm.barrier();
    else
      throw std::invalid_argument("unknown collective " + op);
  }
  double mine_us = (MPI_Wtime() - t0) * 1e6 / iterations, slowest = 0;
  MPI_Allreduce(&mine_us, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return slowest;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, p = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  CLI::App app{"mpi-bench: MPI collectives, measured like ddp-bench"};
  std::vector<std::string> ops{"all_reduce"};
  std::string min_b = "4", max_b = "64M", csv, label = "Open MPI";
  double factor = 2, seconds = 0.2, settle = 0.3;
  int warmup = 5, iters = 0, rounds = 3;
  std::string via = "mpi";
  app.add_option("-o,--op", ops,
                 "all_reduce broadcast reduce all_gather reduce_scatter all_to_all barrier");
  app.add_option("-b,--min-bytes", min_b);
  app.add_option("-e,--max-bytes", max_b);
  app.add_option("-f,--factor", factor);
  app.add_option("-w,--warmup", warmup);
  app.add_option("--seconds", seconds);
  app.add_option("--settle", settle);
  app.add_option("-i,--iters", iters);
  app.add_option("--csv", csv);
  app.add_option("--label", label);
  app.add_option("--via", via, "mpi (raw calls), ddp (Communicator<backend::Mpi>) or both")
      ->check(CLI::IsMember({"mpi", "ddp", "both"}));
  app.add_option("--rounds", rounds, "--via both: alternations per size (best of each)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    MPI_Finalize();
    return rc;
  }
  const auto max_bytes = bench::parse_size(max_b);
  std::vector<float> a(std::max<std::size_t>(static_cast<std::size_t>(p), max_bytes / 4), 1.0f),
      b(a.size(), 1.0f);
  std::optional<DdpMpi> comm;
  if (via != "mpi") comm.emplace(DdpMpi::init());  // adopts the MPI initialized above
  const auto measure = [&](bool through_ddp, const std::string& op, int count, int n) {
    return through_ddp ? time_ddp(*comm, op, a.data(), b.data(), count, n, p)
                       : time_op(op, a.data(), b.data(), count, n, p);
  };
  const bool ddp_only = via == "ddp", both = via == "both";
  std::vector<bench::Row> rows;
  if (settle > 0 && !ops.empty()) {  // untimed, like ddp-bench: let the scheduler settle first
    const double probe = measure(ddp_only, ops.front(), p, 3);
    (void)measure(ddp_only, ops.front(), p,
                  static_cast<int>(std::clamp(settle * 1e6 / std::max(probe, 0.01), 1.0, 1e6)));
  }
  for (const auto& op : ops) {
    if (rank == 0 && both) {
      fmt::print(
          "# {} over {} ranks, float32: raw MPI vs ddp::Communicator<backend::Mpi>, best "
          "of {} alternations\n{:>12} {:>12} {:>12} {:>10}\n",
          op, p, rounds, "bytes", "mpi_us", "ddp_us", "ddp/mpi");
    } else if (rank == 0) {
      bench::print_header(stdout, fmt::format("{} over {} ranks ({}), float32", op, p,
                                              ddp_only ? "ddp on MPI" : "MPI"));
    }
    for (std::uint64_t bytes = bench::parse_size(min_b); bytes <= max_bytes;) {
      int count = static_cast<int>(std::max<std::uint64_t>(1, bytes / 4));
      if (op != "all_reduce" && op != "broadcast" && op != "reduce")
        count = std::max(p, count / p * p);
      (void)measure(ddp_only, op, count, warmup);
      int n = iters;
      if (n <= 0) {
        const double probe = measure(ddp_only, op, count, 3);
        n = static_cast<int>(std::clamp(seconds * 1e6 / std::max(probe, 0.01), 5.0, 100000.0));
      }
      if (both) {
        (void)measure(true, op, count, warmup);
        double raw = 1e300, wrapped = 1e300;
        for (int k = 0; k < rounds; ++k) {
          raw = std::min(raw, measure(false, op, count, n));
          wrapped = std::min(wrapped, measure(true, op, count, n));
        }
        if (rank == 0)
          fmt::print("{:>12} {:>12.2f} {:>12.2f} {:>10.3f}\n", count * 4, raw, wrapped,
                     wrapped / raw);
      } else {
        bench::Row r;
        r.op = op;
        r.count = static_cast<std::uint64_t>(count);
        r.bytes = r.count * 4;
        r.dtype = "float32";
        r.redop = (op == "all_reduce" || op == "reduce" || op == "reduce_scatter") ? "sum" : "";
        r.iterations = n;
        r.time_us = measure(ddp_only, op, count, n);
        r.algbw = static_cast<double>(r.bytes) / (r.time_us * 1e3);
        r.busbw = r.algbw * bench::bus_factor(op, p);
        if (rank == 0) bench::print_row(stdout, r);
        rows.push_back(r);
      }
      const auto next = static_cast<std::uint64_t>(std::ceil(static_cast<double>(bytes) * factor));
      bytes = next > bytes ? next : bytes + 1;
    }
  }
  comm.reset();
  if (rank == 0 && !csv.empty()) bench::write_csv(csv, rows, label);
  MPI_Finalize();
  return 0;
}
