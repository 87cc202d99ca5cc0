// fingerprint-bench: what checking that all ranks called the same collective costs.
//
//   build/release/bench/fingerprint-bench -n 2 -t shm      (forks 2 ranks; or run under ddprun)
//
// Each rank opens two communicators over the same transport, one with verify_collectives on
// and one with it off, and times blocks of --iters small all_reduces on each in turn (the order
// alternates per block). This machine's speed drifts by up to 3x within a minute; blocks a few
// milliseconds apart see the same speed, so the median of the per-block ratios is a steadier
// figure than comparing two runs. Times are the slowest rank's.
#include <ddp/ddp.hpp>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Comm = ddp::Communicator<ddp::backend::Host>;

struct Config {
  int nproc = 2;
  std::string transport = "shm";
  std::size_t bytes = 4;
  int iters = 20000;
  int blocks = 101;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Microseconds per call of `iters` all_reduces, the slowest rank's.
double block_us(Comm& comm, Comm& agree, std::vector<float>& buf, int iters) {
  agree.barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) comm.all_reduce(buf);
  std::vector<double> us{std::chrono::duration<double, std::micro>(Clock::now() - t0).count() /
                         iters};
  agree.all_reduce(us, ddp::ReduceOp::max);
  return us[0];
}

void run(const ddp::Environment& env, const Config& cfg) {
  ddp::Options o;
  o.transport = cfg.transport == "tcp" ? ddp::HostTransport::tcp : ddp::HostTransport::shm;
  o.group = "verify-on";
  o.verify_collectives = true;
  auto on = Comm::init(env, o);
  o.group = "verify-off";
  o.verify_collectives = false;
  auto off = Comm::init(env, o);
  std::vector<float> buf(std::max<std::size_t>(1, cfg.bytes / sizeof(float)), 1.0f);
  (void)block_us(on, off, buf, cfg.iters);  // warm-up of both
  (void)block_us(off, off, buf, cfg.iters);
  std::vector<double> t_on, t_off, ratio;
  for (int b = 0; b < cfg.blocks; ++b) {
    double x = 0, y = 0;
    if (b % 2 == 0) {
      x = block_us(on, off, buf, cfg.iters);
      y = block_us(off, off, buf, cfg.iters);
    } else {
      y = block_us(off, off, buf, cfg.iters);
      x = block_us(on, off, buf, cfg.iters);
    }
    t_on.push_back(x);
    t_off.push_back(y);
    ratio.push_back(x / y);
  }
  if (env.rank == 0) {
    std::printf("# all_reduce of %zu B over %d ranks (%s), %d blocks of %d calls\n",
                buf.size() * sizeof(float), env.world_size, cfg.transport.c_str(), cfg.blocks,
                cfg.iters);
    std::printf("| transport | ranks | verify on (µs) | verify off (µs) | cost |\n");
    std::printf("|---|---|---|---|---|\n");
    std::printf("| %s | %d | %.3f | %.3f | %+.1f%% |\n", cfg.transport.c_str(), env.world_size,
                median(t_on), median(t_off), 100 * (median(ratio) - 1));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fingerprint-bench: the cost of checking that all ranks called the same collective"};
  Config cfg;
  app.add_option("-n,--nproc", cfg.nproc, "ranks to fork when not under a launcher");
  app.add_option("-t,--transport", cfg.transport, "shm or tcp")
      ->check(CLI::IsMember({"shm", "tcp"}));
  app.add_option("-b,--bytes", cfg.bytes, "all_reduce size in bytes (float32)");
  app.add_option("-i,--iters", cfg.iters, "calls per block")->check(CLI::PositiveNumber);
  app.add_option("--blocks", cfg.blocks, "blocks per setting (median)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  const auto env = ddp::Environment::detect();
  try {
    if (env.launcher == "none")
      ddp::spawn(cfg.nproc, [&](const ddp::Environment& e) { run(e, cfg); });
    else
      run(env, cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fingerprint-bench: %s\n", e.what());
    return 1;
  }
}
