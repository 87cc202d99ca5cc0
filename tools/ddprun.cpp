// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
//
// ddprun: starts a program's worker processes on this node, like torchrun. The command line of
// ddp::launch (tools/launch/, one room: launch.hpp and its parts), where the agent lives.
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
// goes on to the console, and ddprun exits 1 where it would have exited 0. With --on-failure
// shrink a worker's failure stops nobody: the others go on without it (Communicator::shrink), and
// the attempt succeeds when the workers that remain finish successfully. With --on-failure
// rejoin the failed worker is also restarted alone (same RANK and WORLD_SIZE, DDP_REJOIN=N; its
// log appended), up to --max-restarts times per worker, and joins the running job
// (Communicator::enter).

#include <ddp/ddp.hpp>

#include "launch/launch.hpp"

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace {

struct Config {
  std::string nproc = "1";
  std::string nnodes = "1";
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool standalone = false;
  int max_restarts = 0;
  std::string on_failure = "restart";
  double restart_backoff = 0.1;
  double restart_backoff_max = 5;
  std::string log_dir;
  bool no_prefix = false;
  double grace = 5;
  double join_timeout = 300;
  double last_call = 1;  // --nnodes MIN:MAX: seconds to wait for more nodes once MIN are there
  std::string rdzv_endpoint;
  bool endpoint_given = false;
  bool no_python = false;
  bool module = false;
  std::string redirects;
  std::string tee;
  std::string local_ranks_filter;
  // torchrun's other flags: honoured where they mean something for ddprun, else noted.
  std::string rdzv_backend = "static";
  std::string rdzv_id;
  std::string rdzv_conf;
  std::string role = "default";
  std::string prefix_template;
  double shutdown_timeout = -1;
  bool run_path = false;
  std::vector<std::string> notes;  // "--flag value: why it changes nothing here"
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

/// --nnodes N, or torchrun's MIN:MAX range: {min, max} (the same number twice: a fixed count).
std::pair<int, int> parse_nnodes(const std::string& spec) {
  const auto number = [&](std::string_view t) {
    int n = 0;
    const auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), n);
    if (ec != std::errc{} || end != t.data() + t.size() || n < 1 || n > 65536)
      die(2, fmt::format("--nnodes: expected a number of nodes from 1 to 65536, or MIN:MAX; got "
                         "\"{}\"",
                         spec));
    return n;
  };
  const auto colon = spec.find(':');
  if (colon == std::string::npos) return {number(spec), number(spec)};
  const int lo = number(std::string_view(spec).substr(0, colon));
  const int hi = number(std::string_view(spec).substr(colon + 1));
  if (lo > hi) die(2, fmt::format("--nnodes {}: MIN is larger than MAX", spec));
  return {lo, hi};
}

/// --rdzv-conf key=value,...: join_timeout is honoured (seconds); torchrun's other keys are
/// noted; anything that is not key=value is refused.
void apply_rdzv_conf(Config& cfg) {
  std::string_view rest = cfg.rdzv_conf;
  while (!rest.empty()) {
    const auto comma = std::min(rest.find(','), rest.size());
    const std::string_view item = rest.substr(0, comma);
    rest = comma < rest.size() ? rest.substr(comma + 1) : std::string_view{};
    const auto eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0)
      die(2, fmt::format("--rdzv-conf: expected key=value,...; got \"{}\"", cfg.rdzv_conf));
    const std::string key(item.substr(0, eq));
    const std::string value(item.substr(eq + 1));
    if (key == "last_call_timeout") {
      double t = 0;
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), t);
      if (ec != std::errc{} || end != value.data() + value.size() || !(t >= 0 && t <= 86400))
        die(2, fmt::format("--rdzv-conf {}: expected seconds, got \"{}\"", key, value));
      cfg.last_call = t;
    } else if (key == "join_timeout" || key == "timeout") {
      double t = 0;
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), t);
      if (ec != std::errc{} || end != value.data() + value.size() || !(t > 0 && t <= 1e7))
        die(2, fmt::format("--rdzv-conf {}: expected seconds, got \"{}\"", key, value));
      cfg.join_timeout = t;
    } else {
      cfg.notes.push_back(
          fmt::format("--rdzv-conf {}={}: ddprun's rendezvous has no such setting "
                      "(join_timeout and last_call_timeout are the ones it takes)",
                      key, value));
    }
  }
}

std::chrono::milliseconds millis(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
}

/// --help's usage line names the program and its arguments (CLI11's own says only [OPTIONS]).
struct Usage : CLI::Formatter {
  std::string make_usage(const CLI::App*, std::string) const override {
    return "Usage: ddprun [OPTIONS] PROGRAM [ARGS...]\n";
  }
};

/// A number of at least 0 (`zero_ok`) or above it: what CLI11's NonNegativeNumber and
/// PositiveNumber check, said without the 309 digits of the largest double they print.
CLI::Validator number_above_zero(bool zero_ok) {
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(value.c_str(), &end);
        if (value.empty() || end == nullptr || *end != '\0' || !std::isfinite(x))
          return fmt::format("{} is not a number", value);
        if (zero_ok ? x >= 0 : x > 0) return {};
        return zero_ok ? fmt::format("{} is negative: give 0 or more", value)
                       : fmt::format("{} is not positive: give more than 0", value);
      },
      zero_ok ? "NUMBER >= 0" : "NUMBER > 0");
}

}  // namespace

int main(int argc, char** argv) {
  Config cfg;
  const CLI::Validator non_negative = number_above_zero(true), positive = number_above_zero(false);
  CLI::App app{
      "Launches the worker processes of a ddp (or torch.distributed) program. A PROGRAM ending in "
      ".py runs with $PYTHON (default: python3 on PATH)."};
  app.formatter(std::make_shared<Usage>());
  // Both spellings: --nproc-per-node and torchrun's --nproc_per_node.
  app.add_option("--nproc-per-node,--nproc_per_node", cfg.nproc,
                 "workers on this node: a number, gpu (visible CUDA devices), cpu (usable CPUs) "
                 "or auto (gpu when there are GPUs, else cpu)")
      ->capture_default_str();
  app.add_option(
         "--nnodes", cfg.nnodes,
         "number of nodes, or torchrun's MIN:MAX: start with MIN, admit late nodes up to MAX")
      ->capture_default_str();
  app.add_option("--node-rank,--node_rank", cfg.node_rank, "this node's rank, 0 to nnodes-1")
      ->check(non_negative)
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
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--on-failure,--on_failure", cfg.on_failure,
                 "what a worker's failure does: restart (stop every worker; --max-restarts may "
                 "start the group again), shrink (the others go on without it, forming a "
                 "smaller communicator with Communicator::shrink) or rejoin (as shrink, and the "
                 "failed worker is restarted alone with DDP_REJOIN=N to join the running job, "
                 "up to --max-restarts times each)")
      ->check(CLI::IsMember({"restart", "shrink", "rejoin"}))
      ->capture_default_str();
  app.add_option("--restart-backoff", cfg.restart_backoff,
                 "seconds to wait before restarting after a failed attempt, doubled after each "
                 "further failed attempt in a row (an attempt that ran 30 s or more begins a new "
                 "row); 0 restarts at once")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--restart-backoff-max", cfg.restart_backoff_max,
                 "the longest wait before a restart, in seconds")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--log-dir,--log_dir", cfg.log_dir,
                 "also write each worker's output to DIR/attempt_K/rank_R.log, byte for byte");
  app.add_flag("--no-prefix,--no_prefix", cfg.no_prefix, "do not prefix output lines with [rR]");
  app.add_option("--grace", cfg.grace, "seconds between SIGTERM and SIGKILL when stopping workers")
      ->check(non_negative)
      ->capture_default_str();
  app.add_option("--join-timeout,--join_timeout", cfg.join_timeout,
                 "seconds to wait for every node to join, and for the others to finish")
      ->check(positive)
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
  // The rest of torchrun 2.x's command line, so that launch scripts run unchanged.
  app.add_option("--rdzv-backend,--rdzv_backend", cfg.rdzv_backend,
                 "static or c10d (the same here: node 0's ddprun hosts the rendezvous store at "
                 "--rdzv-endpoint or --master-addr:--master-port), or etcd (the store in the etcd "
                 "cluster at --rdzv-endpoint HOST:PORT[,HOST:PORT...], no node hosting it: "
                 "needs --rdzv-id, new for each job)")
      ->capture_default_str();
  app.add_option("--rdzv-id,--rdzv_id", cfg.rdzv_id,
                 "the job's name: the workers' TORCHELASTIC_RUN_ID");
  app.add_option("--rdzv-conf,--rdzv_conf", cfg.rdzv_conf,
                 "key=value,...: join_timeout (seconds, as --join-timeout), last_call_timeout "
                 "(seconds to wait for more nodes once MIN of --nnodes MIN:MAX are there, "
                 "default 1); other keys are noted");
  app.add_option("--role", cfg.role, "the workers' ROLE_NAME")->capture_default_str();
  app.add_option("--log-line-prefix-template,--log_line_prefix_template", cfg.prefix_template,
                 "prefix of each output line instead of [rRANK]: ${role_name}, ${local_rank}, "
                 "${rank} and ${hostname} are replaced");
  app.add_option("--shutdown-timeout,--shutdown_timeout", cfg.shutdown_timeout,
                 "as --grace: seconds between SIGTERM and SIGKILL when stopping workers")
      ->check(non_negative);
  app.add_flag("--run-path,--run_path", cfg.run_path,
               "torchrun runs the script in its own interpreter; ddprun runs it with python3");
  // Accepted, and noted once on stderr: they describe how torchrun's Python agent works.
  const auto noted = [&](const std::string& names, const std::string& why, bool flag = false) {
    const std::string first = names.substr(0, names.find(','));
    if (flag) {
      app.add_flag_callback(
             names, [&cfg, first, why] { cfg.notes.push_back(first + ": " + why); },
             "accepted for torchrun's command lines: " + why)
          ->group("torchrun's flags that change nothing here");
    } else {
      app.add_option_function<std::string>(
             names,
             [&cfg, first, why](const std::string& v) {
               cfg.notes.push_back(first + " " + v + ": " + why);
             },
             "accepted for torchrun's command lines: " + why)
          ->group("torchrun's flags that change nothing here");
    }
  };
  noted("--monitor-interval,--monitor_interval",
        "ddprun learns of a worker's exit at once (it waits on its workers; nothing is polled)");
  noted("--start-method,--start_method",
        "workers are programs of their own, started with fork and exec");
  noted("--event-log-handler,--event_log_handler", "ddprun logs no elastic events");
  noted("--local-addr,--local_addr",
        "the workers reach node 0 at --master-addr; the kernel picks the local address");
  noted("--logs-specs,--logs_specs",
        "a Python entry point; ddprun's logs go to --log-dir/attempt_K/rank_R.log");
  noted("--duplicate-stdout-filters,--duplicate_stdout_filters",
        "use --log-dir and grep the log files");
  noted("--duplicate-stderr-filters,--duplicate_stderr_filters",
        "use --log-dir and grep the log files");
  noted("--numa-binding,--numa_binding", "ddprun does not bind workers to CPUs (use numactl)");
  noted("--signals-to-handle,--signals_to_handle",
        "ddprun forwards SIGINT, SIGTERM and SIGHUP to every worker");
  noted("--virtual-local-rank,--virtual_local_rank",
        "each worker gets its own LOCAL_RANK; CUDA_VISIBLE_DEVICES is left as it is", true);
  app.set_version_flag("--version", fmt::format("ddprun (ddp {})", DDP_VERSION_STRING));
  app.prefix_command();  // everything from the program on belongs to it
  app.footer(
      "Output lines are prefixed with [rRANK] and never interleave. Exit status: 0, or the "
      "status of the first worker that failed (128 + N for signal N); 1 when every worker "
      "succeeded but a log file could not be written in full (ddprun names it); 2 for bad "
      "arguments.");
  // torchrun reads every option left off the command line from PET_<NAME> (PET_NNODES,
  // PET_NPROC_PER_NODE, PET_RDZV_ENDPOINT, ...): so does ddprun.
  for (CLI::Option* opt : app.get_options()) {
    const auto& names = opt->get_lnames();
    if (names.empty() || names.front() == "help" || names.front() == "version") continue;
    std::string env = "PET_";
    for (const char c : names.front())
      env += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    opt->envname(env);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {  // every other mistake on the command line: status 2
    die(2, fmt::format("{} (see ddprun --help)", e.what()));
  }
  cfg.command = app.remaining();
  if (!cfg.command.empty() && cfg.command.front() == "--") cfg.command.erase(cfg.command.begin());
  if (cfg.command.empty()) die(2, "no program given: ddprun [OPTIONS] program [args...]");
  if (cfg.command.front().starts_with("-"))
    die(2, fmt::format("unknown option {} (see ddprun --help)", cfg.command.front()));
  const auto [min_nodes, nnodes] = parse_nnodes(cfg.nnodes);
  const bool etcd = cfg.rdzv_backend == "etcd" || cfg.rdzv_backend == "etcd-v2";
  if (cfg.rdzv_backend != "static" && cfg.rdzv_backend != "c10d" && !etcd)
    die(2, fmt::format("--rdzv-backend {}: unknown rendezvous backend; use c10d or static (node "
                       "0's ddprun hosts the store), or etcd, with --rdzv-endpoint",
                       cfg.rdzv_backend));
  std::string store_url;
  if (etcd) {  // HOST[:PORT][,HOST[:PORT]...], etcd's port 2379 by default
    if (cfg.rdzv_endpoint.empty())
      die(2,
          "--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] (the etcd "
          "cluster's client URLs)");
    if (cfg.rdzv_id.empty() || cfg.rdzv_id == "none")
      die(2,
          "--rdzv-backend etcd needs --rdzv-id NAME, new for each job (the job's keys in "
          "etcd live under it)");
    if (cfg.standalone) die(2, "--standalone hosts its own store: drop --rdzv-backend etcd");
    if (cfg.rdzv_endpoint.starts_with("etcd://")) cfg.rdzv_endpoint.erase(0, 7);
    store_url = "etcd://";
    for (std::size_t at = 0; at <= cfg.rdzv_endpoint.size();) {
      const std::size_t comma = std::min(cfg.rdzv_endpoint.find(',', at), cfg.rdzv_endpoint.size());
      std::string ep = cfg.rdzv_endpoint.substr(at, comma - at);
      const auto colon = ep.rfind(':');
      if (colon == std::string::npos || (ep.front() == '[' && colon < ep.find(']'))) ep += ":2379";
      store_url += (at == 0 ? "" : ",") + ep;
      at = comma + 1;
    }
    try {
      (void)ddp::detail::EtcdAddress::parse(store_url, "--rdzv-endpoint");
    } catch (const ddp::Error& e) {
      die(2, e.what());
    }
    cfg.rdzv_endpoint.clear();  // not a store of ddprun's own
  }
  apply_rdzv_conf(cfg);
  if (cfg.shutdown_timeout >= 0) cfg.grace = cfg.shutdown_timeout;
  if (cfg.run_path)
    cfg.notes.emplace_back(
        "--run-path: the script runs with python3 (or $PYTHON), not in "
        "ddprun's own interpreter");
  for (const std::string& note : cfg.notes) fmt::print(stderr, "ddprun: note: {}\n", note);

  if (!cfg.rdzv_endpoint.empty()) {  // HOST[:PORT], or [IPv6][:PORT]; torchrun's port: 29400
    const std::string& e = cfg.rdzv_endpoint;
    const auto colon = e.rfind(':');
    const bool has_port = colon != std::string::npos && (e.front() != '[' || colon > e.find(']'));
    std::string host = has_port ? e.substr(0, colon) : e;
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
      host = host.substr(1, host.size() - 2);
    int port = 29400;
    if (has_port) {
      const std::string p = e.substr(colon + 1);
      const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), port);
      if (ec != std::errc{} || end != p.data() + p.size() || port < 1 || port > 65535) port = 0;
    }
    if (host.empty() || port == 0)
      die(2, fmt::format("--rdzv-endpoint: expected HOST[:PORT], got \"{}\"", e));
    cfg.master_addr = host;
    cfg.master_port = port;
    cfg.endpoint_given = true;
  }
  if (cfg.module && cfg.no_python) die(2, "--module runs python3 -m: drop --no-python");
  if (cfg.module || (!cfg.no_python && cfg.command.front().ends_with(".py"))) {
    const char* python = std::getenv("PYTHON");
    std::vector<std::string> run{python != nullptr && *python != '\0' ? python : "python3", "-u"};
    if (cfg.module) run.emplace_back("-m");
    cfg.command.insert(cfg.command.begin(), run.begin(), run.end());
  }
  if (cfg.node_rank >= nnodes)
    die(2, fmt::format("--node-rank {} is out of range: --nnodes is {}", cfg.node_rank, nnodes));
  if (cfg.standalone) {
    if (nnodes != 1) die(2, "--standalone runs a single node; drop --nnodes");
    cfg.master_addr = "127.0.0.1";
  }
  ddp::LaunchOptions o;
  o.nproc_per_node = resolve_nproc(cfg.nproc);
  o.nnodes = nnodes;
  o.min_nodes = min_nodes != nnodes ? min_nodes : 0;
  o.last_call = millis(cfg.last_call);
  // c10d without --node-rank: numbered on arrival, node 0 being the one at the endpoint.
  o.node_rank = (cfg.rdzv_backend == "c10d" || etcd) && nnodes > 1 && app.count("--node-rank") == 0
                    ? -1
                    : cfg.node_rank;
  o.store_url = store_url;
  o.master_addr = cfg.master_addr;
  if (cfg.endpoint_given) {
    o.endpoint_flags = "--rdzv-endpoint";
    o.port_flag = "port in --rdzv-endpoint";
  }
  o.master_port = cfg.standalone ? 0 : cfg.master_port;
  o.max_restarts = cfg.max_restarts;
  o.shrink_on_failure = cfg.on_failure == "shrink";
  o.rejoin_on_failure = cfg.on_failure == "rejoin";
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
  o.prefix_template = cfg.prefix_template;
  o.role = cfg.role;
  if (!cfg.rdzv_id.empty()) o.run_id = cfg.rdzv_id;
  o.grace = millis(cfg.grace);
  o.join_timeout = millis(cfg.join_timeout);
  o.command = cfg.command;
  try {
    return ddp::launch(o);
  } catch (const ddp::Error& e) {
    die(e.code() == ddp::Errc::invalid_argument ? 2 : 1,
        o.node_rank < 0 ? std::string(e.what())
                        : fmt::format("node {}: {}", o.node_rank, e.what()));
  }
}
