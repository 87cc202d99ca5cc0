// gradient-bench: the training layer's speed on ResNet-50's gradients (161 tensors, 25.6 M floats).
//
//   build/release/bench/gradient-bench -n 2            (forks 2 ranks; or run under ddprun)
//
// Time per step (slowest rank, median of --reps steps) of:
//   per-tensor   average_gradients of PyTorch's distributed tutorial: all_reduce(sum) of every
//   tensor, then divide ps           parameter-server style: gather everything to rank 0, average
//   there,
//                broadcast back
//   bucketed     GradientAverager::average() (25 MiB buckets, ReduceOp::avg)
//   bucketed+bf16  the same with bfloat16 compression
// and the overlap of communication with a simulated backward pass (compute per tensor in
// reverse order, mark_ready after each): exposed communication = step time - compute time,
// against the communication time without overlap.
#include <ddp/ddp.hpp>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
using Comm = ddp::Communicator<ddp::backend::Host>;

struct Param {
  std::vector<float> value, grad;
};

// torchvision's resnet50().parameters(), in order: 161 tensors, 25,557,032 floats.
std::vector<std::size_t> resnet50_sizes() {
  std::vector<std::size_t> s;
  const auto conv = [&](std::size_t out, std::size_t in, std::size_t k) {
    s.push_back(out * in * k * k);
  };
  const auto bn = [&](std::size_t c) {
    s.push_back(c);
    s.push_back(c);
  };
  conv(64, 3, 7);
  bn(64);
  std::size_t in = 64;
  const std::size_t mids[] = {64, 128, 256, 512}, blocks[] = {3, 4, 6, 3};
  for (int stage = 0; stage < 4; ++stage) {
    const std::size_t mid = mids[stage], out = mid * 4;
    for (std::size_t b = 0; b < blocks[stage]; ++b) {
      conv(mid, in, 1);
      bn(mid);
      conv(mid, mid, 3);
      bn(mid);
      conv(out, mid, 1);
      bn(out);
      if (b == 0) {
        conv(out, in, 1);
        bn(out);
      }
      in = out;
    }
  }
  s.push_back(1000 * 2048);
  s.push_back(1000);
  return s;
}

double now_us() {
  return std::chrono::duration<double, std::micro>(Clock::now().time_since_epoch()).count();
}

// Median over reps of the slowest rank's time of fn().
double measure(Comm& comm, int reps, const std::function<void()>& fn) {
  fn();  // warm up
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    comm.barrier();
    const double t0 = now_us();
    fn();
    std::vector<double> t{now_us() - t0};
    comm.all_reduce(t, ddp::ReduceOp::max);
    times.push_back(t[0]);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Work standing in for backward: about `us` microseconds of arithmetic on this core (spin), or of
// waiting, as for a GPU kernel that leaves the CPU free (sleep).
volatile double g_sink = 0;
bool g_sleep = false;
void compute_for(double us) {
  if (g_sleep) {
    std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(us));
    return;
  }
  const double until = now_us() + us;
  double x = 1;
  while (now_us() < until)
    for (int k = 0; k < 64; ++k) x = x * 1.0000001 + 1e-9;
  g_sink = x;
}

void run(ddp::Environment env, int reps) {
  auto comm = Comm::init(env);
  std::vector<Param> model;
  for (std::size_t n : resnet50_sizes())
    model.push_back({std::vector<float>(n, 0.01f),
                     std::vector<float>(n, 1.0f + static_cast<float>(comm.rank()))});
  std::size_t floats = 0;
  for (const auto& p : model) floats += p.grad.size();
  const float size = static_cast<float>(comm.size());

  const double per_tensor = measure(comm, reps, [&] {
    for (auto& p : model) {  // the tutorial's average_gradients
      comm.all_reduce(p.grad, ddp::ReduceOp::sum);
      for (auto& g : p.grad) g /= size;
    }
  });
  std::vector<float> flat(floats),
      all(comm.rank() == 0 ? floats * static_cast<std::size_t>(comm.size()) : 0);
  const double ps = measure(comm, reps, [&] {
    std::size_t at = 0;
    for (const auto& p : model) {
      std::copy(p.grad.begin(), p.grad.end(), flat.begin() + static_cast<std::ptrdiff_t>(at));
      at += p.grad.size();
    }
    comm.gather(flat, all, 0);
    if (comm.rank() == 0) {
      for (std::size_t k = 0; k < floats; ++k) {
        float s = 0;
        for (int r = 0; r < comm.size(); ++r) s += all[static_cast<std::size_t>(r) * floats + k];
        flat[k] = s / size;
      }
    }
    comm.broadcast(flat, 0);
    at = 0;
    for (auto& p : model) {
      std::copy_n(flat.begin() + static_cast<std::ptrdiff_t>(at), p.grad.size(), p.grad.begin());
      at += p.grad.size();
    }
  });
  ddp::GradientAverager avg(comm, model);
  const double bucketed = measure(comm, reps, [&] { avg.average(); });
  ddp::GradientAverager avg16(comm, model, {.compression = ddp::Compression::bfloat16});
  const double bf16 = measure(comm, reps, [&] { avg16.average(); });

  // Overlap: backward computes gradients last to first; compute per tensor proportional to its
  // size, in total about the communication time (compute >= communication).
  const double compute_total = bucketed * 1.1;
  const auto backward = [&](bool overlap) {
    for (std::size_t i = model.size(); i-- > 0;) {
      compute_for(compute_total * static_cast<double>(model[i].grad.size()) /
                  static_cast<double>(floats));
      if (overlap) avg.mark_ready(i);
    }
    if (overlap)
      avg.synchronize();
    else
      avg.average();
  };
  const double sequential = measure(comm, reps, [&] { backward(false); });
  const double overlapped = measure(comm, reps, [&] { backward(true); });
  const double compute_only = measure(comm, reps, [&] {
    for (std::size_t i = model.size(); i-- > 0;)
      compute_for(compute_total * static_cast<double>(model[i].grad.size()) /
                  static_cast<double>(floats));
  });

  if (comm.rank() == 0) {
    fmt::print(
        "# ResNet-50 gradients: {} tensors, {} floats ({:.1f} MB), {} ranks ({} transport)\n",
        model.size(), floats, static_cast<double>(floats) * 4 / 1e6, comm.size(),
        comm.backend().transport());
    fmt::print("| method | time per step (ms) | vs per-tensor |\n|---|---:|---:|\n");
    const auto row = [&](const char* name, double us) {
      fmt::print("| {} | {:.2f} | {:.2f}x |\n", name, us / 1e3, per_tensor / us);
    };
    row("per-tensor all_reduce + divide (tutorial)", per_tensor);
    row("parameter server: gather, average on rank 0, broadcast", ps);
    row("GradientAverager, 25 MiB buckets", bucketed);
    row("GradientAverager + bfloat16 compression", bf16);
    const double comm_time = sequential - compute_only;
    const double exposed = overlapped - compute_only;
    fmt::print(
        "\n# overlap ({} compute): compute {:.2f} ms, communication without overlap {:.2f} ms, "
        "exposed with mark_ready {:.2f} ms = {:.0f}% of it\n",
        g_sleep ? "sleep" : "spin", compute_only / 1e3, comm_time / 1e3, exposed / 1e3,
        100 * std::max(0.0, exposed) / comm_time);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gradient-bench: the training layer on ResNet-50's gradients"};
  int nproc = 2, reps = 7;
  app.add_option("-n,--nproc", nproc, "ranks to fork when not under a launcher");
  app.add_option("--reps", reps, "measured steps per method (median)");
  std::string compute = "spin";
  app.add_option("--compute", compute,
                 "simulated backward: spin (this core computes) or sleep (an accelerator does)")
      ->check(CLI::IsMember({"spin", "sleep"}));
  CLI11_PARSE(app, argc, argv);
  g_sleep = compute == "sleep";
  const auto env = ddp::Environment::detect();
  try {
    if (env.launcher == "none")
      ddp::spawn(nproc, [&](ddp::Environment e) { run(e, reps); });
    else
      run(env, reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gradient-bench: %s\n", e.what());
    return 1;
  }
}
