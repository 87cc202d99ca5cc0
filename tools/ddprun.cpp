// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
//
// ddprun: starts a program's worker processes on this node, like torchrun. The command line of
// ddp::launch (tools/launch_agent.hpp), where the agent lives.
//
//   ddprun --nproc-per-node 4 ./train --epochs 3
//   ddprun --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node 2 ./train   (node 0)
//   ddprun --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --nproc-per-node 2 ./train   (node 1)
//
// The agent on node 0 hosts the rendezvous store at MASTER_ADDR:MASTER_PORT; every agent connects
// to it to register its node, to learn the first rank of its workers, to tell the others when one
// of its workers failed, and to agree on restarts. Each worker gets RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, NODE_RANK, GROUP_RANK, MASTER_ADDR, DDP_RESTART_COUNT, DDP_LAUNCHER=ddprun,
// DDP_STORE_HOSTED=1 and DDP_STORE_PORT (ddprun's store, which ddp's workers use), MASTER_PORT (a
// free port on node 0 that the program's rank 0 may bind: torch.distributed's TCPStore does), and
// what torchrun's workers read: GROUP_WORLD_SIZE, ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE,
// TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID and
// TORCHELASTIC_ERROR_FILE (a worker that writes torchrun's JSON there has its message reported).
// With TORCHELASTIC_ERROR_FILE set for ddprun itself, it writes the root cause there.
//
// Failure policy: the first worker to exit non-zero or by a signal is the root cause. The agent
// stops the other workers (SIGTERM to each worker's process group, SIGKILL after --grace), tells
// the other nodes, which stop theirs, prints "rank 2 (local_rank 2, pid N) was killed by SIGKILL
// (signal 9) after 12.3 s", and exits with that worker's status (128 + the signal for a signal),
// unless --max-restarts allows another attempt of the whole group, after a wait that doubles with
// each failed attempt in a row (--restart-backoff, --restart-backoff-max). SIGINT, SIGTERM and
// SIGHUP sent to ddprun are forwarded to every worker; a second one kills them at once. Log files
// get the workers' bytes as they are; one that cannot be written is named, its worker's output
// goes on to the console, and ddprun exits 1 where it would have exited 0.

#include <ddp/ddp.hpp>

#include "launch_agent.hpp"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace {

struct Config {
  std::string nproc = "1";
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  int max_restarts = 0;
  double restart_backoff = 0.1;
  double restart_backoff_max = 5;
  std::string log_dir;
  bool no_prefix = false;
  double grace = 5;
  double join_timeout = 300;
  std::string rdzv_endpoint;
  bool no_python = false;
  bool module = false;
  std::string redirects;
  std::string tee;
  std::string local_ranks_filter;
  std::vector<std::string> command;
};

[[noreturn]] void die(int code, const std::string& msg) {
  fmt::print(stderr, "ddprun: {}\n", msg);
  std::exit(code);
}

int resolve_nproc(const std::string& spec) {
  if (spec == "gpu" || spec == "auto") {
    if (const int n = ddp::visible_cuda_devices(); n > 0) return n;
    if (spec == "gpu")
      die(2,
          "--nproc-per-node gpu: no CUDA device is visible (CUDA_VISIBLE_DEVICES, "
          "/proc/driver/nvidia/gpus); give a number instead");
    return ddp::detail::usable_cpus();
  }
  if (spec == "cpu") return ddp::detail::usable_cpus();
  int n = 0;
  const auto [end, ec] = std::from_chars(spec.data(), spec.data() + spec.size(), n);
  if (ec != std::errc{} || end != spec.data() + spec.size() || n < 1 || n > 4096)
    die(2, fmt::format("--nproc-per-node: expected a number from 1 to 4096, gpu, cpu or auto; "
                       "got \"{}\"",
                       spec));
  return n;
}

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  CLI::App app{
      "ddprun [OPTIONS] PROGRAM [ARGS...]\n"
      "Launches the worker processes of a ddp (or torch.distributed) program. A PROGRAM ending in "
      ".py runs with $PYTHON (default: python3 on PATH)."};
  // Both spellings: --nproc-per-node and torchrun's --nproc_per_node.
  app.add_option("--nproc-per-node,--nproc_per_node", cfg.nproc,
                 "workers on this node: a number, gpu (visible CUDA devices), cpu (usable CPUs) "
                 "or auto (gpu when there are GPUs, else cpu)")
      ->capture_default_str();
  app.add_option("--nnodes", cfg.nnodes, "number of nodes")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  app.add_option("--node-rank,--node_rank", cfg.node_rank, "this node's rank, 0 to nnodes-1")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--master-addr,--master_addr", cfg.master_addr,
                 "address of node 0, where the rendezvous store listens")
      ->capture_default_str();
  app.add_option("--master-port,--master_port", cfg.master_port, "port of the rendezvous store")
      ->check(CLI::Range(1, 65535))
      ->capture_default_str();
  app.add_flag("--standalone", cfg.standalone,
               "a single node on 127.0.0.1 with a free port (no --master-* needed)");
  app.add_option("--max-restarts,--max_restarts", cfg.max_restarts,
                 "restart the whole group up to this many times after a failure")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--restart-backoff", cfg.restart_backoff,
                 "seconds to wait before restarting after a failed attempt, doubled after each "
                 "further failed attempt in a row (an attempt that ran 30 s or more begins a new "
                 "row); 0 restarts at once")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--restart-backoff-max", cfg.restart_backoff_max,
                 "the longest wait before a restart, in seconds")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--log-dir,--log_dir", cfg.log_dir,
                 "also write each worker's output to DIR/attempt_K/rank_R.log, byte for byte");
  app.add_flag("--no-prefix,--no_prefix", cfg.no_prefix, "do not prefix output lines with [rR]");
  app.add_option("--grace", cfg.grace, "seconds between SIGTERM and SIGKILL when stopping workers")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--join-timeout,--join_timeout", cfg.join_timeout,
                 "seconds to wait for every node to join, and for the others to finish")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", cfg.rdzv_endpoint,
                 "HOST:PORT of the rendezvous store: --master-addr and --master-port in one "
                 "(torchrun's spelling)");
  app.add_flag("--no-python,--no_python", cfg.no_python,
               "run the program as it is, even a .py file (which is otherwise run with python3, "
               "or $PYTHON, as torchrun does)");
  app.add_flag("-m,--module", cfg.module,
               "the program is a Python module: run python3 -m MODULE (as torchrun -m)");
  app.add_option("-r,--redirects", cfg.redirects,
                 "send workers' streams to their log files only: 0 none, 1 stdout, 2 stderr, 3 "
                 "both, or LOCAL_RANK:N,... (as torchrun; logs in --log-dir, else a new "
                 "directory under $TMPDIR)");
  app.add_option("-t,--tee", cfg.tee,
                 "send workers' streams to the console and their log files: same values as "
                 "--redirects");
  app.add_option("--local-ranks-filter,--local_ranks_filter", cfg.local_ranks_filter,
                 "show only these local ranks' output on the console, e.g. 0 or 0,2 (the log "
                 "files still get everything)");
  app.prefix_command();  // everything from the program on belongs to it
  app.footer(
      "Output lines are prefixed with [rRANK] and never interleave. Exit status: 0, or the "
      "status of the first worker that failed (128 + N for signal N); 1 when every worker "
      "succeeded but a log file could not be written in full (ddprun names it); 2 for bad "
      "arguments.");
  CLI11_PARSE(app, argc, argv);
  cfg.command = app.remaining();
  if (!cfg.command.empty() && cfg.command.front() == "--") cfg.command.erase(cfg.command.begin());
  if (cfg.command.empty()) die(2, "no program given: ddprun [OPTIONS] program [args...]");
  if (cfg.command.front().starts_with("-"))
    die(2, fmt::format("unknown option {} (see ddprun --help)", cfg.command.front()));

  if (!cfg.rdzv_endpoint.empty()) {  // HOST:PORT, or [IPv6]:PORT
    const auto colon = cfg.rdzv_endpoint.rfind(':');
    std::string host = colon == std::string::npos ? "" : cfg.rdzv_endpoint.substr(0, colon);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
      host = host.substr(1, host.size() - 2);
    int port = 0;
    const std::string p = colon == std::string::npos ? "" : cfg.rdzv_endpoint.substr(colon + 1);
    const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), port);
    if (host.empty() || ec != std::errc{} || end != p.data() + p.size() || port < 1 || port > 65535)
      die(2, fmt::format("--rdzv-endpoint: expected HOST:PORT, got \"{}\"", cfg.rdzv_endpoint));
    cfg.master_addr = host;
    cfg.master_port = port;
  }
  if (cfg.module && cfg.no_python) die(2, "--module runs python3 -m: drop --no-python");
  if (cfg.module || (!cfg.no_python && cfg.command.front().ends_with(".py"))) {
    const char* python = std::getenv("PYTHON");
    std::vector<std::string> run{python != nullptr && *python != '\0' ? python : "python3", "-u"};
    if (cfg.module) run.emplace_back("-m");
    cfg.command.insert(cfg.command.begin(), run.begin(), run.end());
  }
  if (cfg.node_rank >= cfg.nnodes)
    die(2,
        fmt::format("--node-rank {} is out of range: --nnodes is {}", cfg.node_rank, cfg.nnodes));
  if (cfg.standalone) {
    if (cfg.nnodes != 1) die(2, "--standalone runs a single node; drop --nnodes");
    cfg.master_addr = "127.0.0.1";
  }
  ddp::LaunchOptions o;
  o.nproc_per_node = resolve_nproc(cfg.nproc);
  o.nnodes = cfg.nnodes;
  o.node_rank = cfg.node_rank;
  o.master_addr = cfg.master_addr;
  o.master_port = cfg.standalone ? 0 : cfg.master_port;
  o.max_restarts = cfg.max_restarts;
  o.restart_backoff = millis(cfg.restart_backoff);
  o.restart_backoff_max = millis(cfg.restart_backoff_max);
  // Absolute, as torchrun's: workers that change directory still find their error files.
  o.log_dir = cfg.log_dir.empty() ? cfg.log_dir : std::filesystem::absolute(cfg.log_dir).string();
  o.redirects = cfg.redirects;
  o.tee = cfg.tee;
  for (std::size_t at = 0;
       !cfg.local_ranks_filter.empty() && at <= cfg.local_ranks_filter.size();) {
    const std::size_t comma =
        std::min(cfg.local_ranks_filter.find(',', at), cfg.local_ranks_filter.size());
    const std::string item = cfg.local_ranks_filter.substr(at, comma - at);
    int r = -1;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), r);
    if (ec != std::errc{} || end != item.data() + item.size() || r < 0)
      die(2, fmt::format("--local-ranks-filter: expected local ranks like 0 or 0,2; got \"{}\"",
                         cfg.local_ranks_filter));
    o.local_ranks_filter.push_back(r);
    at = comma + 1;
  }
  o.prefix_output = !cfg.no_prefix;
  o.grace = millis(cfg.grace);
  o.join_timeout = millis(cfg.join_timeout);
  o.command = cfg.command;
  try {
    return ddp::launch(o);
  } catch (const ddp::Error& e) {
    die(e.code() == ddp::Errc::invalid_argument ? 2 : 1,
        fmt::format("node {}: {}", cfg.node_rank, e.what()));
  }
}
