// ddp-bench: collective benchmarks for ddp in the style of nccl-tests.
//
//   ddp-bench -n 2 --op all_reduce -b 4 -e 64M            # forks 2 ranks itself
//   ddprun --nproc-per-node 4 ddp-bench --op all_gather     # or under any launcher
//   ddp-bench -n 2 --csv ddp.csv --plot busbw.svg --compare mpi.csv
//
// Each size is timed over enough iterations to last about --seconds (at least 5), after
// --warmup calls; the time reported is the slowest rank's average. busbw follows nccl-tests.
#include <ddp/ddp.hpp>

#include <fmt/format.h>
#include <sched.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

using Comm = ddp::Communicator<ddp::backend::Host>;
using Clock = std::chrono::steady_clock;

struct Config {
  std::vector<std::string> ops{"all_reduce"};
  int nproc = 2;
  std::uint64_t min_bytes = 4, max_bytes = 64ull << 20;
  double factor = 2;
  std::string dtype = "float32";
  std::string redop = "sum";
  std::string transport = "auto";
  int warmup = 5;
  double settle = 0.3;
  double seconds = 0.2;
  int iters = 0;
  std::string csv, json, plot, label = "ddp";
  std::vector<std::string> compare;
  bool check = false;
  std::size_t segment = 0;
  int hosts = 1;
  bool bind = false;
};

ddp::ReduceOp parse_redop(const std::string& s) {
  for (auto op : {ddp::ReduceOp::sum, ddp::ReduceOp::prod, ddp::ReduceOp::min, ddp::ReduceOp::max,
                  ddp::ReduceOp::avg}) {
    if (ddp::to_string(op) == s) return op;
  }
  throw CLI::ValidationError("--redop", "unknown reduction " + s);
}

template <class T>
double time_op(Comm& comm, const std::string& op, std::span<T> a, std::span<T> b,
               ddp::ReduceOp redop, int iterations) {
  const int p = comm.size();
  const std::size_t n = a.size();
  comm.barrier();
  const auto t0 = Clock::now();
  const std::size_t block = n / static_cast<std::size_t>(p);
  const std::size_t me = static_cast<std::size_t>(comm.rank());
  for (int i = 0; i < iterations; ++i) {
    if (op == "all_reduce") {
      comm.all_reduce(a, redop);
    } else if (op == "broadcast") {
      comm.broadcast(a, 0);
    } else if (op == "reduce") {
      comm.reduce(a, 0, redop);
    } else if (op == "all_gather") {  // in place: this rank's block of the output is the input
      comm.all_gather(a.subspan(me * block, block), a);
    } else if (op == "gather") {
      comm.gather(a.first(block), b, 0);
    } else if (op == "scatter") {
      comm.scatter(b, a.first(block), 0);
    } else if (op == "reduce_scatter") {
      comm.reduce_scatter(a, b.first(block), redop);
    } else if (op == "all_to_all") {
      comm.all_to_all(a, b);
    } else if (op == "barrier") {
      comm.barrier();
    } else {
      throw std::invalid_argument("unknown collective " + op);
    }
  }
  const double mine =
      std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iterations;
  std::vector<double> slowest{mine};
  comm.all_reduce(slowest, ddp::ReduceOp::max);
  return slowest[0];
}

template <class T>
void run(Comm& comm, const Config& cfg, std::vector<bench::Row>& rows) {
  const int p = comm.size();
  const auto redop = parse_redop(cfg.redop);
  const std::size_t max_count = std::max<std::size_t>(1, cfg.max_bytes / sizeof(T));
  // Allocated and touched once: first touch of fresh pages is slow and is not what we measure.
  std::vector<T> a(std::max<std::size_t>(max_count, static_cast<std::size_t>(p)), T(1)),
      b(a.size(), T(1));
  if (cfg.settle > 0 && !cfg.ops.empty()) {
    // Freshly started ranks run slow until the scheduler has spread them over the cores (most
    // visible with more ranks than cores): run the first measurement's collective untimed for a
    // while first. mpi-bench does the same.
    std::span<T> sa(a.data(), static_cast<std::size_t>(p));
    std::span<T> sb(b.data(), sa.size());
    const double probe = time_op(comm, cfg.ops.front(), sa, sb, redop, 3);
    (void)time_op(comm, cfg.ops.front(), sa, sb, redop,
                  static_cast<int>(std::clamp(cfg.settle * 1e6 / std::max(probe, 0.01), 1.0, 1e6)));
  }
  for (const auto& op : cfg.ops) {
    if (comm.rank() == 0) {
      bench::print_header(
          stdout,
          fmt::format(
              "{} over {} ranks ({} transport, {}), {} {}", op, p, comm.backend().transport(),
              comm.backend().hierarchy(), cfg.dtype,
              op == "all_reduce" || op == "reduce" || op == "reduce_scatter" ? cfg.redop : ""));
    }
    for (std::uint64_t bytes = cfg.min_bytes; bytes <= cfg.max_bytes;) {
      // Sizes divisible by the number of ranks where the collective splits the buffer.
      std::size_t count = std::max<std::size_t>(1, bytes / sizeof(T));
      if (op != "all_reduce" && op != "broadcast" && op != "reduce") {
        count =
            std::max<std::size_t>(static_cast<std::size_t>(p), count / static_cast<std::size_t>(p) *
                                                                   static_cast<std::size_t>(p));
      }
      std::span<T> sa(a.data(), count), sb(b.data(), count);
      (void)time_op(comm, op, sa, sb, redop, cfg.warmup);
      int iterations = cfg.iters;
      if (iterations <= 0) {
        const double probe = time_op(comm, op, sa, sb, redop, 3);  // the same on every rank
        iterations =
            static_cast<int>(std::clamp(cfg.seconds * 1e6 / std::max(probe, 0.01), 5.0, 1e7));
      }
      bench::Row r;
      r.op = op;
      r.count = count;
      r.bytes = count * sizeof(T);
      r.dtype = cfg.dtype;
      r.redop = (op == "all_reduce" || op == "reduce" || op == "reduce_scatter") ? cfg.redop : "";
      r.iterations = iterations;
      r.time_us = time_op(comm, op, sa, sb, redop, iterations);
      r.algbw = static_cast<double>(r.bytes) / (r.time_us * 1e3);
      r.busbw = r.algbw * bench::bus_factor(op, p);
      if (cfg.check && op == "all_reduce") {
        for (std::size_t i = 0; i < count; ++i) sa[i] = T(static_cast<float>(comm.rank() + 1));
        comm.all_reduce(sa, ddp::ReduceOp::sum);
        const float want = static_cast<float>(p * (p + 1) / 2);
        std::int64_t wrong = 0;
        for (std::size_t i = 0; i < count; ++i) wrong += static_cast<float>(sa[i]) != want;
        std::vector<std::int64_t> total{wrong};
        comm.all_reduce(total);
        if (total[0] != 0)
          throw std::runtime_error(fmt::format("{} wrong elements at {} bytes", total[0], r.bytes));
      }
      if (comm.rank() == 0) bench::print_row(stdout, r);
      rows.push_back(r);
      const auto next =
          static_cast<std::uint64_t>(std::ceil(static_cast<double>(bytes) * cfg.factor));
      bytes = next > bytes ? next : bytes + 1;
    }
  }
}

/// Pins this rank to one of the CPUs it may use (local rank modulo their number), as mpirun does
/// by default for 2 ranks: the ranks then never share a core, and never migrate.
void bind_to_cpu(const ddp::Environment& env) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  std::vector<std::size_t> cpus;
  for (std::size_t c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  }
  if (cpus.empty()) return;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpus[static_cast<std::size_t>(env.local_rank) % cpus.size()], &one);
  if (::sched_setaffinity(0, sizeof one, &one) != 0)
    throw std::runtime_error(fmt::format("--bind: sched_setaffinity: {}", std::strerror(errno)));
}

void bench_rank(const ddp::Environment& env, const Config& cfg) {
  if (cfg.bind) bind_to_cpu(env);
  ddp::Options o;
  if (cfg.transport == "shm")
    o.transport = ddp::HostTransport::shm;
  else if (cfg.transport == "tcp")
    o.transport = ddp::HostTransport::tcp;
  o.segment_bytes = cfg.segment;
  // --hosts: the forked ranks play H hosts of consecutive ranks (DDP_HOST_ID, as a launcher
  // across machines would give them different hosts).
  if (cfg.hosts > 1 && env.launcher == "spawn") {
    const std::string id = std::to_string(env.rank * cfg.hosts / env.world_size);
    ::setenv("DDP_HOST_ID", id.c_str(), 1);
  }
  auto comm = Comm::init(env, o);
  std::vector<bench::Row> rows;
  if (cfg.dtype == "float32")
    run<float>(comm, cfg, rows);
  else if (cfg.dtype == "float64")
    run<double>(comm, cfg, rows);
  else if (cfg.dtype == "float16")
    run<ddp::half>(comm, cfg, rows);
  else if (cfg.dtype == "bfloat16")
    run<ddp::bfloat16>(comm, cfg, rows);
  else if (cfg.dtype == "int32")
    run<std::int32_t>(comm, cfg, rows);
  else if (cfg.dtype == "int64")
    run<std::int64_t>(comm, cfg, rows);
  else if (cfg.dtype == "int8")
    run<std::int8_t>(comm, cfg, rows);
  else if (cfg.dtype == "uint8")
    run<std::uint8_t>(comm, cfg, rows);
  else
    throw std::invalid_argument("unsupported --dtype " + cfg.dtype);
  if (comm.rank() != 0) return;
  if (!cfg.csv.empty()) bench::write_csv(cfg.csv, rows, cfg.label);
  if (!cfg.json.empty()) bench::write_json(cfg.json, rows, cfg.label);
  if (!cfg.plot.empty()) {
    std::map<std::string, std::vector<bench::Row>> series;
    series[cfg.label] = rows;
    for (const auto& file : cfg.compare) {
      for (auto& [label, row] : bench::read_csv(file)) series[label].push_back(row);
    }
    bench::write_svg(cfg.plot, series,
                     fmt::format("{} busbw, {} ranks", cfg.ops.front(), comm.size()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{"ddp-bench: collective benchmarks for ddp (nccl-tests style)"};
  std::string min_b = "4", max_b = "64M";
  app.add_option("-o,--op", cfg.ops,
                 "collectives: all_reduce broadcast reduce all_gather gather scatter "
                 "reduce_scatter all_to_all barrier");
  app.add_option("-n,--nproc", cfg.nproc, "ranks to fork when not started by a launcher")
      ->check(CLI::Range(1, 256));
  app.add_option("-b,--min-bytes", min_b, "smallest size (K/M/G suffixes)");
  app.add_option("-e,--max-bytes", max_b, "largest size");
  app.add_option("-f,--factor", cfg.factor, "size multiplier between steps")
      ->check(CLI::Range(1.01, 1024.0));
  app.add_option("-d,--dtype", cfg.dtype,
                 "float32 float64 float16 bfloat16 int32 int64 int8 uint8");
  app.add_option("-r,--redop", cfg.redop, "sum prod min max avg");
  app.add_option("-t,--transport", cfg.transport, "auto, shm or tcp")
      ->check(CLI::IsMember({"auto", "shm", "tcp"}));
  app.add_option("-w,--warmup", cfg.warmup, "untimed calls per size")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seconds", cfg.seconds, "target time per size (sets the iteration count)");
  app.add_option("--settle", cfg.settle, "untimed seconds before the first size")
      ->check(CLI::NonNegativeNumber);
  app.add_option("-i,--iters", cfg.iters, "fixed iteration count (overrides --seconds)");
  app.add_option("--segment-bytes", cfg.segment, "Options::segment_bytes (0: default)");
  app.add_option("--hosts", cfg.hosts,
                 "forked ranks play this many hosts (DDP_HOST_ID): shared memory inside, TCP "
                 "between (DDP_HIERARCHY picks how all_reduce crosses)")
      ->check(CLI::PositiveNumber);
  app.add_option("--csv", cfg.csv, "write the results as CSV");
  app.add_option("--json", cfg.json, "write the results as JSON");
  app.add_option("--plot", cfg.plot, "write an SVG plot of busbw against size");
  app.add_option("--compare", cfg.compare,
                 "CSV files (e.g. from mpi-bench) to draw in the same plot");
  app.add_option("--label", cfg.label, "name of this run in CSV/JSON/plots");
  app.add_flag("-c,--check", cfg.check, "verify all_reduce results");
  app.add_flag("--bind", cfg.bind,
               "pin each rank to one CPU (local rank modulo the usable CPUs), as mpirun binds");
  CLI11_PARSE(app, argc, argv);
  try {
    cfg.min_bytes = bench::parse_size(min_b);
    cfg.max_bytes = bench::parse_size(max_b);
    const auto env = ddp::Environment::detect();
    if (env.launcher != "none") {
      bench_rank(env, cfg);
    } else {
      ddp::spawn(cfg.nproc, [&](ddp::Environment e) { bench_rank(e, cfg); });
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "ddp-bench: {}\n", e.what());
    return 1;
  }
  return 0;
}
