// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
//
// The worker program of the launcher tests (tests/launch/test_ddprun.py): a real ddp program
// whose behaviour each test picks with its arguments.
//
//   worker allreduce                  init a communicator, all_reduce, check, print (then wait
//                                     $WORKER_HOLD_MS before leaving)
//   worker exit RANK CODE [once]      RANK exits with CODE (only in the first attempt with once);
//                                     the others all_reduce (once) or wait to be stopped
//   worker signal RANK SIG            RANK raises SIG (9 = SIGKILL, 11 = SIGSEGV); others wait
//   worker wait DIR [ignore-term]     write DIR/pid.RANK, note any signal in DIR/got.RANK, wait
//   worker lines N                    print N long lines in several partial writes each
//   worker grandchild DIR             start a process (pid in DIR/grandchild.RANK), then fail
//   worker loop DIR                   all_reduce forever (pid in DIR/pid.RANK)
//   worker descendants DIR            start `sleep 300 &` through a shell and a daemon that left
//                                     the process group (setsid), write their pids and
//                                     DIR/pid.RANK, wait
//   worker init-exit RANK CODE        init a communicator, then RANK exits with CODE at once; the
//                                     others all_reduce (and fail)
//   worker lag RANK                   three all_reduces, then RANK sleeps 30 s while the others
//                                     call a fourth (which times out: run with DDP_TIMEOUT)
//   worker elastic R:E:S,...          the README's ddp::Elastic loop; world rank R dies at step
//                                     S of epoch E (stops itself there: R:E:S:stop); the others
//                                     print the model's hash
//   worker sharded STEPS              SGD-momentum on a model of three units, fully sharded and
//                                     whole (GradientAverager) from the same data; prints
//                                     whether the parameters are bitwise the same

#include <ddp/ddp.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

std::string g_dir;
int g_rank = 0;

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

extern "C" void note_signal(int sig) {
  // Test program: not async-signal-safe in general, but the process does nothing else.
  const std::string path = g_dir + "/got." + std::to_string(g_rank);
  const std::string text = std::to_string(sig);
  FILE* f = std::fopen(path.c_str(), "w");
  if (f != nullptr) {
    std::fputs(text.c_str(), f);
    std::fclose(f);
  }
  ::_exit(0);
}

void wait_forever() {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

/// The launcher's restart count: ddprun's DDP_RESTART_COUNT or torchrun's
/// TORCHELASTIC_RESTART_COUNT ("?" under a launcher with neither).
std::string restart_count() {
  const ddp::detail::EnvReader env;
  return env.get("DDP_RESTART_COUNT", env.get("TORCHELASTIC_RESTART_COUNT", "?"));
}

int all_reduce_and_check() {
  auto comm = ddp::Communicator<ddp::backend::Host>::init();
  const int p = comm.size();
  std::vector<float> v(100000, static_cast<float>(comm.rank() + 1));
  comm.all_reduce(v);
  const float want = static_cast<float>(p * (p + 1) / 2);
  for (float x : v) {
    if (x != want) {
      std::cerr << "rank " << comm.rank() << ": wrong sum " << x << ", want " << want << "\n";
      return 1;
    }
  }
  const auto env = ddp::Environment::detect();
  std::cout << "rank " << comm.rank() << "/" << p << " local " << comm.local_rank() << "/"
            << comm.local_size() << " node " << env.node_rank << " launcher " << env.launcher
            << " transport " << comm.backend().transport();
  // Across hosts, how all_reduce runs (flat on one host: nothing, as before).
  if (comm.backend().hierarchy() != "flat")
    std::cout << " hierarchy " << comm.backend().hierarchy();
  std::cout << " restart " << restart_count() << " sum ok" << std::endl;
  // WORKER_HOLD_MS: keep the communicator (and rank 0's store) a while before leaving.
  std::this_thread::sleep_for(
      std::chrono::milliseconds(std::stoi(ddp::detail::EnvReader().get("WORKER_HOLD_MS", "0"))));
  return 0;
}

/// A model of four parameters for "train": value and gradient per parameter.
struct Param {
  std::vector<float> value, grad;
};
struct Model {
  std::vector<Param> params;
  std::vector<Param>& parameters() { return params; }
};

/// train STEPS: GradientAverager over a 1 MB model, its gradients marked ready in backward's
/// order between slices of computation (so that buckets overlap it), a checkpoint save at the end.
int train(int steps) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init();
  Model m;
  for (int i = 0; i < 4; ++i)
    m.params.push_back({std::vector<float>(1 << 16, 1.0f), std::vector<float>(1 << 16, 0.0f)});
  ddp::GradientAverager avg(comm, m, {.bucket_bytes = 1 << 18});
  volatile double sink = 0;
  for (int step = 0; step < steps; ++step) {
    {
      ddp::TimelineSpan forward("forward");
      for (int i = 0; i < 300000; ++i) sink = sink + i;
    }
    for (int i = 3; i >= 0; --i) {
      ddp::TimelineSpan backward("backward");
      for (int k = 0; k < 150000; ++k) sink = sink + k;
      auto& g = m.params[static_cast<std::size_t>(i)].grad;
      std::fill(g.begin(), g.end(), static_cast<float>(comm.rank() + step));
      avg.mark_ready(static_cast<std::size_t>(i));
    }
    avg.synchronize();
  }
  ddp::Checkpoint ck;
  ck.put_values("w", m.params[0].value);
  const std::string dir = ddp::detail::EnvReader().get("WORKER_CHECKPOINT_DIR", "/tmp");
  ck.save(dir + "/ddp-worker-ck-" + std::to_string(comm.rank()) + "-" + std::to_string(::getpid()));
  std::cout << "rank " << comm.rank() << " trained " << steps << " steps" << std::endl;
  return 0;
}

/// sharded STEPS: FullyShardedAverager against GradientAverager, SGD with momentum, gradients
/// whose sums round differently in different orders (large and small values, by rank): the
/// fully sharded parameters must be bitwise the whole model's, also across hosts, where
/// all_reduce adds each host's sum.
int sharded(int steps) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init();
  const std::vector<std::vector<std::size_t>> units{{3001, 17}, {4096}, {5, 999, 1}};
  const auto initial = [](std::size_t u, std::size_t i, std::size_t k) {
    return 0.01f * static_cast<float>((u * 131 + i * 17 + k * 7) % 97) - 0.4f;
  };
  const auto gradient = [&](std::size_t u, std::size_t i, std::size_t k, int step) {
    const float big = (k + static_cast<std::size_t>(comm.rank())) % 3 == 0 ? 1.0e4f : 1.0f;
    return big *
           (1.0f +
            1e-3f * static_cast<float>(
                        (k * 7 + u + i + static_cast<std::size_t>(comm.rank() + step)) % 11)) *
           (comm.rank() % 2 == 0 ? 1.0f : -0.75f);
  };
  constexpr float lr = 1e-4f, momentum = 0.9f;
  Model whole;
  for (std::size_t u = 0; u < units.size(); ++u)
    for (std::size_t i = 0; i < units[u].size(); ++i) {
      Param q{std::vector<float>(units[u][i]), std::vector<float>(units[u][i])};
      for (std::size_t k = 0; k < q.value.size(); ++k) q.value[k] = initial(u, i, k);
      whole.params.push_back(std::move(q));
    }
  std::vector<std::vector<float>> whole_velocity;
  for (const auto& q : whole.params) whole_velocity.emplace_back(q.value.size(), 0.0f);
  ddp::GradientAverager avg(comm, whole);
  ddp::FullyShardedAverager fsdp(
      comm, units, [&](std::size_t u, std::size_t i, std::size_t offset, std::span<float> v) {
        for (std::size_t k = 0; k < v.size(); ++k) v[k] = initial(u, i, offset + k);
      });
  std::vector<std::vector<float>> velocity;  // per shard slice, in shard() order
  for (const auto& sl : fsdp.shard()) velocity.emplace_back(sl.value.size, 0.0f);
  const auto sgd = [&](float& w, float g, float& v) {
    v = momentum * v + g;
    w -= lr * v;
  };
  for (int step = 0; step < steps; ++step) {
    std::size_t first = 0;
    for (std::size_t u = 0; u < units.size(); ++u) {
      for (std::size_t i = 0; i < units[u].size(); ++i) {
        auto& g = whole.params[first + i].grad;
        for (std::size_t k = 0; k < g.size(); ++k) g[k] = gradient(u, i, k, step);
      }
      first += units[u].size();
    }
    avg.average();
    for (std::size_t j = 0; j < whole.params.size(); ++j)
      for (std::size_t k = 0; k < whole.params[j].value.size(); ++k)
        sgd(whole.params[j].value[k], whole.params[j].grad[k], whole_velocity[j][k]);

    for (std::size_t u = units.size(); u-- > 0;) {
      const std::span<float> g = fsdp.grad(u);
      std::size_t at = 0;
      for (std::size_t i = 0; i < units[u].size(); ++i)
        for (std::size_t k = 0; k < units[u][i]; ++k) g[at++] = gradient(u, i, k, step);
      fsdp.reduce(u);
    }
    fsdp.synchronize();
    const auto slices = fsdp.shard();
    for (std::size_t s = 0; s < slices.size(); ++s)
      for (std::size_t k = 0; k < slices[s].value.size; ++k)
        sgd(slices[s].value.data[k], slices[s].grad.data[k], velocity[s][k]);
  }
  std::size_t first = 0, differ = 0;
  for (std::size_t u = 0; u < units.size(); ++u) {
    const std::span<float> w = fsdp.gather(u);
    std::size_t at = 0;
    for (std::size_t i = 0; i < units[u].size(); ++i)
      for (const float x : whole.params[first + i].value)
        if (std::memcmp(&x, &w[at++], sizeof x) != 0) ++differ;
    fsdp.release(u);
    first += units[u].size();
  }
  std::cout << "rank " << comm.rank() << " hierarchy " << comm.backend().hierarchy() << " "
            << (differ == 0 ? "sharded bitwise" : std::to_string(differ) + " elements differ")
            << std::endl;
  return differ == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) try {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) return 2;
  const auto env = ddp::Environment::detect();
  g_rank = env.rank;
  const std::string& mode = args[0];
  if (mode == "allreduce") return all_reduce_and_check();
  if (mode == "train" && args.size() >= 2) return train(std::stoi(args[1]));
  if (mode == "sharded" && args.size() >= 2) return sharded(std::stoi(args[1]));
  if (mode == "exit" && args.size() >= 3) {
    const bool once = args.size() > 3 && args[3] == "once";
    const bool first = restart_count() == "0";
    if (env.rank == std::stoi(args[1]) && (!once || first)) {
      std::cerr << "rank " << env.rank << " fails on purpose" << std::endl;
      return std::stoi(args[2]);
    }
    if (once) return all_reduce_and_check();
    wait_forever();
  }
  if (mode == "signal" && args.size() >= 3) {
    if (env.rank == std::stoi(args[1])) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      const int sig = std::stoi(args[2]);
      ::signal(sig, SIG_DFL);  // a sanitizer's SIGSEGV handler would turn the crash into an exit
      ::raise(sig);
    }
    wait_forever();
  }
  if (mode == "wait" && args.size() >= 2) {
    g_dir = args[1];
    struct sigaction sa {};
    sa.sa_handler = note_signal;
    for (int sig : {SIGINT, SIGHUP}) ::sigaction(sig, &sa, nullptr);
    if (args.size() > 2 && args[2] == "ignore-term")
      ::signal(SIGTERM, SIG_IGN);
    else
      ::sigaction(SIGTERM, &sa, nullptr);
    write_file(g_dir + "/pid." + std::to_string(env.rank), std::to_string(::getpid()));
    wait_forever();
  }
  if (mode == "lines" && args.size() >= 2) {
    const int n = std::stoi(args[1]);
    for (int i = 0; i < n; ++i) {
      const std::string line = "rank " + std::to_string(env.rank) + " line " + std::to_string(i) +
                               " " + std::string(static_cast<std::size_t>(100 + i % 900), 'x') +
                               " end\n";
      // In three pieces, so a launcher that forwards reads as they come would interleave.
      const std::size_t third = line.size() / 3;
      for (std::size_t at = 0; at < line.size(); at += third) {
        const std::size_t k = std::min(third, line.size() - at);
        if (::write(i % 2 == 0 ? 1 : 2, line.data() + at, k) != static_cast<ssize_t>(k)) return 3;
      }
    }
    return 0;
  }
  if (mode == "grandchild" && args.size() >= 2) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::execlp("sleep", "sleep", "60", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    write_file(args[1] + "/grandchild." + std::to_string(env.rank), std::to_string(pid));
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return env.rank == 0 ? 5 : 0;
  }
  if (mode == "descendants" && args.size() >= 2) {
    const std::string r = std::to_string(env.rank);
    if (std::system(("sleep 300 & echo $! > " + args[1] + "/bg." + r).c_str()) != 0) return 3;
    if (const pid_t child = ::fork(); child == 0) {
      ::setsid();  // leaves the worker's process group and session
      if (const pid_t daemon = ::fork(); daemon == 0) {
        ::execlp("sleep", "sleep", "300", static_cast<char*>(nullptr));
        ::_exit(127);
      } else {
        write_file(args[1] + "/daemon." + r, std::to_string(daemon));
      }
      ::_exit(0);
    } else {
      ::waitpid(child, nullptr, 0);
    }
    write_file(args[1] + "/pid." + r, std::to_string(::getpid()));
    wait_forever();
  }
  if (mode == "init-exit" && args.size() >= 3) {
    auto comm = ddp::Communicator<ddp::backend::Host>::init();
    if (comm.rank() == std::stoi(args[1])) ::_exit(std::stoi(args[2]));
    std::vector<float> v(1000, 1.0f);
    comm.all_reduce(v);
    return 0;
  }
  if (mode == "uncaught" && args.size() >= 3) {  // uncaught RANK ddp|std
    auto comm = ddp::Communicator<ddp::backend::Host>::init();
    if (comm.rank() == std::stoi(args[1])) {
      // As a program whose main lets an exception escape: std::terminate (this main catches).
      std::thread([kind = args[2], r = comm.rank()] {
        if (kind == "ddp")
          ddp::detail::fail(ddp::Errc::invalid_argument, "rank ", r,
                            ": the model has no parameters (on purpose)");
        throw std::runtime_error("bad batch shape (on purpose)");
      }).join();
    }
    std::vector<float> v(1000, 1.0f);
    comm.all_reduce(v);
    return 0;
  }
  if (mode == "loop" && args.size() >= 2) {
    auto comm = ddp::Communicator<ddp::backend::Host>::init();
    std::vector<float> v(1000, 1.0f);
    comm.all_reduce(v);
    write_file(args[1] + "/pid." + std::to_string(comm.rank()), std::to_string(::getpid()));
    std::cout << "rank " << comm.rank() << " transport " << comm.backend().transport() << " looping"
              << std::endl;
    for (;;) {
      comm.all_reduce(v);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  if (mode == "lag" && args.size() >= 2) {
    auto comm = ddp::Communicator<ddp::backend::Host>::init();
    std::vector<float> v(256, 1.0f);
    for (int i = 0; i < 3; ++i) comm.all_reduce(v);
    if (comm.rank() == std::stoi(args[1])) {
      std::this_thread::sleep_for(std::chrono::seconds(30));
      return 0;
    }
    comm.all_reduce(v);
    return 0;
  }
  if (mode == "shrink" && args.size() >= 2) {  // shrink RANK|all: RANK dies; the others go on
    ddp::Options o;
    o.timeout = std::chrono::seconds(20);
    auto comm = ddp::Communicator<ddp::backend::Host>::init(ddp::Environment::detect(), o);
    const int old_rank = comm.rank();
    std::vector<float> v(1000, 1.0f);
    for (int i = 0; i < 3; ++i) comm.all_reduce(v);
    if (args[1] == "all" || old_rank == std::stoi(args[1])) std::_Exit(7);
    try {
      for (;;) comm.all_reduce(v);
    } catch (const ddp::Error& e) {
      comm = comm.shrink({.wait_for_ranks = std::chrono::seconds(10)});
    }
    std::vector<float> w(10, static_cast<float>(old_rank));
    comm.all_reduce(w);
    std::cout << "rank " << old_rank << " is rank " << comm.rank() << " of " << comm.size()
              << " (epoch " << comm.epoch() << "), sum of old ranks " << w[0] << std::endl;
    return 0;
  }
  if (mode == "grow" && args.size() >= 2) {  // grow N: the job admits N processes that come late
    using Host = ddp::Communicator<ddp::backend::Host>;
    ddp::Options o;
    o.timeout = std::chrono::seconds(20);
    std::vector<float> w(10, static_cast<float>(env.rank));
    if (env.rejoin) {  // a node that came late (ddprun --nnodes MIN:MAX)
      auto comm = Host::enter(env, o, {.ticket = "worker"});
      comm.all_reduce(w);
      std::cout << "rank " << env.rank << " joined as rank " << comm.rank() << " of " << comm.size()
                << " (epoch " << comm.epoch() << "), sum of world ranks " << w[0] << std::endl;
      return 0;
    }
    auto comm = Host::init(env, o);
    const int n = std::stoi(args[1]), start = comm.size();
    while (comm.size() < start + n) {  // a request not written yet is admitted at a later grow()
      std::vector<double> waiting{comm.rank() == 0 ? static_cast<double>(comm.waiting_to_enter())
                                                   : 0.0};
      comm.all_reduce(waiting, ddp::ReduceOp::max);
      if (waiting[0] > 0) comm = comm.grow({.ticket = "worker"});
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    comm.all_reduce(w);
    std::cout << "rank " << env.rank << " is rank " << comm.rank() << " of " << comm.size()
              << " (epoch " << comm.epoch() << "), sum of world ranks " << w[0] << std::endl;
    return 0;
  }
  if (mode == "replace") {  // node 0's one worker admits rank 1 (which dies), then rank 2
    using Host = ddp::Communicator<ddp::backend::Host>;
    ddp::Options o;
    o.timeout = std::chrono::seconds(20);
    std::vector<float> w(10, static_cast<float>(env.rank));
    if (env.rejoin) {  // a node that came late, or its replacement
      auto comm = Host::enter(env, o, {.ticket = "worker"});
      comm.all_reduce(w);
      if (env.rank == 1) std::_Exit(9);  // the first late node's worker is lost
      std::cout << "rank " << env.rank << " joined as rank " << comm.rank() << " of " << comm.size()
                << " (epoch " << comm.epoch() << "), sum of world ranks " << w[0] << std::endl;
      return 0;
    }
    auto comm = Host::init(env, o);
    const auto admit_one = [&] {  // a request not written yet is admitted at a later grow()
      for (const int before = comm.size(); comm.size() == before;) {
        std::vector<double> n{static_cast<double>(comm.waiting_to_enter())};
        comm.all_reduce(n, ddp::ReduceOp::max);
        if (n[0] > 0) comm = comm.grow({.ticket = "worker"});
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    };
    admit_one();
    std::vector<float> v(10, 0.0f);
    try {
      comm.all_reduce(v);  // with rank 1, which then dies
      for (;;) comm.all_reduce(v);
    } catch (const ddp::Error&) {
      comm = comm.shrink({.wait_for_ranks = std::chrono::seconds(10)});
    }
    admit_one();
    comm.all_reduce(w);
    std::cout << "rank " << env.rank << " is rank " << comm.rank() << " of " << comm.size()
              << " (epoch " << comm.epoch() << "), sum of world ranks " << w[0] << std::endl;
    return 0;
  }
  if (mode == "rejoin" && args.size() >= 2) {  // rejoin RANK: RANK dies once and rejoins
    using Host = ddp::Communicator<ddp::backend::Host>;
    ddp::Options o;
    o.timeout = std::chrono::seconds(20);
    std::vector<float> w(10, static_cast<float>(env.rank));
    if (env.rejoin) {  // restarted by ddprun --on-failure rejoin
      auto comm = Host::enter(env, o, {.ticket = "worker"});
      comm.all_reduce(w);
      std::cout << "rank " << env.rank << " rejoined as rank " << comm.rank() << " of "
                << comm.size() << " (epoch " << comm.epoch() << "), sum of world ranks " << w[0]
                << std::endl;
      return 0;
    }
    auto comm = Host::init(env, o);
    std::vector<float> v(1000, 1.0f);
    for (int i = 0; i < 3; ++i) comm.all_reduce(v);
    if (env.rank == std::stoi(args[1])) std::_Exit(7);
    try {
      for (;;) comm.all_reduce(v);
    } catch (const ddp::Error&) {
      comm = comm.shrink({.wait_for_ranks = std::chrono::seconds(10)});
    }
    for (const int before = comm.size(); comm.size() == before;) {  // the restarted one joins
      std::vector<double> n{comm.rank() == 0 ? static_cast<double>(comm.waiting_to_enter()) : 0.0};
      comm.all_reduce(n, ddp::ReduceOp::max);
      if (n[0] > 0) comm = comm.grow({.ticket = "worker"});
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    comm.all_reduce(w);
    std::cout << "rank " << env.rank << " is rank " << comm.rank() << " of " << comm.size()
              << " (epoch " << comm.epoch() << "), sum of world ranks " << w[0] << std::endl;
    return 0;
  }
  if (mode == "elastic" && args.size() >= 2) {  // elastic KILLS: the README's Elastic loop
    // KILLS: "R:E:S,..." world rank R dies at step S of epoch E (of its first life). The
    // processes that finish print the bytes of the model as a hash, the world size at the end
    // and whether every sample of every epoch was trained on exactly once.
    // "R:E:S:stop": R stops itself (SIGSTOP) there instead.
    std::vector<std::array<int, 4>> kills;
    for (std::size_t at = 0; at < args[1].size();) {
      std::array<int, 4> k{};
      if (std::sscanf(args[1].c_str() + at, "%d:%d:%d", &k[0], &k[1], &k[2]) == 3) {
        const auto end = args[1].find(',', at);
        k[3] = args[1].substr(at, end == std::string::npos ? std::string::npos : end - at)
                       .ends_with(":stop")
                   ? 1
                   : 0;
        kills.push_back(k);
      }
      const auto comma = args[1].find(',', at);
      at = comma == std::string::npos ? args[1].size() : comma + 1;
    }
    using Host = ddp::backend::Host;
    struct Param {
      std::vector<float> value, grad;
    };
    struct Net {
      std::vector<Param> params{{std::vector<float>(64, 0.5f), std::vector<float>(64)}};
      std::vector<Param>& parameters() { return params; }
    } net;
    constexpr std::size_t samples = 500;
    ddp::DistributedSampler sampler(samples, env.world_size, env.rank,
                                    {.shuffle = true, .seed = 1, .exact = true});
    std::vector<float> count(samples, 0.0f);
    bool once = true;
    ddp::Elastic<Host> job(env);
    job.track_model("net", net).track("count", count).track_sampler("sampler", sampler);
    std::optional<ddp::GradientAverager<Net, Host>> avg;
    job.on_reset([&](ddp::Communicator<Host>& comm) { avg.emplace(comm, net); });
    job.run_epochs(
        sampler, 3, 16,
        [&](ddp::Communicator<Host>& comm, const ddp::ElasticBatch& b) {
          for (const auto& k : kills)
            if (!env.rejoin && k[0] == env.rank && k[1] == b.epoch &&
                k[2] == static_cast<int>(b.step)) {
              if (k[3] == 0) std::_Exit(9);
              ::raise(SIGSTOP);
            }
          std::vector<float> seen(samples, 0.0f);
          for (const std::size_t i : b.indices) {
            seen[i] = 1.0f;
            for (std::size_t j = 0; j < 64; ++j)
              net.params[0].grad[j] += std::sin(0.01f * static_cast<float>(i * 7 + j)) /
                                       static_cast<float>(b.local_batch);
          }
          comm.all_reduce(seen);
          for (std::size_t i = 0; i < samples; ++i) count[i] += seen[i];
          avg->average();
          for (std::size_t j = 0; j < 64; ++j) {
            net.params[0].value[j] -= 0.1f * net.params[0].grad[j];
            net.params[0].grad[j] = 0;
          }
          const char* ms = std::getenv("WORKER_STEP_MS");
          std::this_thread::sleep_for(std::chrono::milliseconds(ms != nullptr ? std::atoi(ms) : 5));
        },
        [&](ddp::Communicator<Host>&, int) {
          for (const float c : count) once = once && c == 1.0f;
          std::fill(count.begin(), count.end(), 0.0f);
        });
    std::uint64_t h = 1469598103934665603ull;
    for (const float v : net.params[0].value) {
      std::uint32_t bits = 0;
      std::memcpy(&bits, &v, sizeof bits);
      h = (h ^ bits) * 1099511628211ull;
    }
    std::cout << "rank " << env.rank << " finished: " << job.comm().size() << " ranks, model "
              << std::hex << h << std::dec << ", every sample once: " << (once ? "yes" : "no")
              << std::endl;
    return 0;
  }
  if (mode == "fail_last") {  // every rank but the last finishes; then the last one fails
    using Host = ddp::Communicator<ddp::backend::Host>;
    ddp::Options o;
    o.timeout = std::chrono::seconds(60);
    if (env.rejoin) {  // restarted to rejoin a job whose members all finished: must not happen
      auto comm = Host::enter(env, o, {.ticket = "worker"});
      std::cout << "rank " << env.rank << " rejoined" << std::endl;
      return 0;
    }
    {
      auto comm = Host::init(env, o);
      std::vector<float> v(10, 1.0f);
      comm.all_reduce(v);
      if (comm.rank() != comm.size() - 1) return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // the others have exited
    std::cerr << "rank " << env.rank << " fails after the others finished" << std::endl;
    std::_Exit(5);
  }
  std::cerr << "worker: unknown arguments\n";
  return 2;
} catch (const std::exception& e) {
  std::cerr << "worker: " << e.what() << std::endl;
  return 1;
}
