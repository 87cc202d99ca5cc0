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
//
//   gradient-bench -n 2 --zero 5   ShardedAverager (ZeRO) against GradientAverager, 5 rounds
//   gradient-bench -n 4 --mirror 5 ShardedAverager steps without and with ShardMirror saves,
//                                  the memory it holds, and the recovery after a rank leaves
//   gradient-bench -n 2 --timeline 7   the timeline's cost (DDP_TIMELINE): steps recorded and
//                                  not recorded in alternating order, 7 rounds, the median of
//                                  the per-round ratios: a training step (GradientAverager, 1 MiB
//                                  buckets, mark_ready during a simulated backward) and the
//                                  tutorial's 161 per-tensor all_reduces
//
// Each round runs both in fresh processes, alternating which goes first: a training step with
// Adam (average, update, and for the sharded one gather), the communication alone, each rank's
// peak resident memory (VmHWM) and the optimizer state it holds; then the per-round ratios and
// their medians.
#include <ddp/ddp.hpp>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <stdexcept>
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

// ---- --zero: ShardedAverager against GradientAverager, with Adam ----

struct ZeroResult {
  double step_us = 0, comm_us = 0;
  double exposed_us = 0;  // the reduction left after a simulated backward (mark_ready as it goes)
  double peak_mb = 0;     // the largest VmHWM of any rank
  double state_mb = 0;    // Adam's moments on one rank
};

// Adam (lr 1e-3, betas 0.9 / 0.999, eps 1e-8) on n elements.
void adam(float* v, const float* g, float* m, float* s, std::size_t n, int t) {
  const float c1 = 1.0f / (1.0f - std::pow(0.9f, static_cast<float>(t)));
  const float c2 = 1.0f / (1.0f - std::pow(0.999f, static_cast<float>(t)));
  for (std::size_t k = 0; k < n; ++k) {
    m[k] = 0.9f * m[k] + 0.1f * g[k];
    s[k] = 0.999f * s[k] + 0.001f * g[k] * g[k];
    v[k] -= 1e-3f * (m[k] * c1) / (std::sqrt(s[k] * c2) + 1e-8f);
  }
}

double vm_hwm_mb() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  double kb = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::sscanf(line, "VmHWM: %lf kB", &kb) == 1) break;
  std::fclose(f);
  return kb / 1024;
}

// The step time of a simulated backward (compute per tensor in reverse order, about `comm_us`
// in all, with mark(i) after tensor i) and sync(), less the compute alone: what the reduction
// adds when it overlaps backward.
template <class Mark, class Sync>
double exposed(Comm& comm, int reps, const std::vector<Param>& model, double comm_us, Mark&& mark,
               Sync&& sync) {
  std::size_t floats = 0;
  for (const auto& p : model) floats += p.grad.size();
  const double total = comm_us * 1.1;
  const auto backward = [&](bool marks) {
    for (std::size_t i = model.size(); i-- > 0;) {
      compute_for(total * static_cast<double>(model[i].grad.size()) / static_cast<double>(floats));
      if (marks) mark(i);
    }
  };
  const double with = measure(comm, reps, [&] {
    backward(true);
    sync();
  });
  const double alone = measure(comm, reps, [&] { backward(false); });
  return std::max(0.0, with - alone);
}

ZeroResult run_zero(ddp::Environment env, int reps, bool sharded) {
  auto comm = Comm::init(env);
  std::vector<Param> model;
  for (std::size_t n : resnet50_sizes())
    model.push_back({std::vector<float>(n, 0.01f),
                     std::vector<float>(n, 1.0f + static_cast<float>(comm.rank()))});
  std::vector<std::vector<float>> m, s;  // Adam's moments: per parameter, or per slice
  int t = 0;
  ZeroResult r;
  if (!sharded) {
    ddp::GradientAverager avg(comm, model);
    for (const auto& p : model) {
      m.emplace_back(p.value.size(), 0.0f);
      s.emplace_back(p.value.size(), 0.0f);
    }
    r.comm_us = measure(comm, reps, [&] { avg.average(); });
    r.exposed_us = exposed(
        comm, reps, model, r.comm_us, [&](std::size_t i) { avg.mark_ready(i); },
        [&] { avg.synchronize(); });
    r.step_us = measure(comm, reps, [&] {
      avg.average();
      ++t;
      for (std::size_t j = 0; j < model.size(); ++j)
        adam(model[j].value.data(), model[j].grad.data(), m[j].data(), s[j].data(),
             model[j].value.size(), t);
    });
  } else {
    ddp::ShardedAverager zero(comm, model);
    for (const auto& sl : zero.shard()) {
      m.emplace_back(sl.value.size, 0.0f);
      s.emplace_back(sl.value.size, 0.0f);
    }
    r.comm_us = measure(comm, reps, [&] {
      zero.average();
      zero.gather();
    });
    r.exposed_us = exposed(
        comm, reps, model, r.comm_us, [&](std::size_t i) { zero.mark_ready(i); },
        [&] { zero.synchronize(); });
    r.step_us = measure(comm, reps, [&] {
      zero.step([&](std::span<ddp::ShardSlice<float>> shard) {
        ++t;
        for (std::size_t j = 0; j < shard.size(); ++j)
          adam(shard[j].value.data, shard[j].grad.data, m[j].data(), s[j].data(),
               shard[j].value.size, t);
      });
    });
  }
  for (const auto& x : m) r.state_mb += 2.0 * static_cast<double>(x.size()) * 4 / 1e6;
  std::vector<double> peak{vm_hwm_mb()};
  comm.all_reduce(peak, ddp::ReduceOp::max);
  r.peak_mb = peak[0];
  return r;
}

// Rounds of `run(env, second)` for second = false and true, each in fresh processes (so that
// each peak is its own), alternating which goes first; rank 0's results, or false when a round
// gave none.
template <class Result, class Run>
bool alternating_rounds(int nproc, int rounds, const char* name, Run&& run,
                        std::vector<Result>& first, std::vector<Result>& second) {
  const std::string file =
      std::string("/tmp/gradient-bench-") + name + "." + std::to_string(::getpid());
  for (int round = 0; round < rounds; ++round) {
    for (int k = 0; k < 2; ++k) {
      const bool which = (k == 1) != (round % 2 == 1);
      ddp::spawn(nproc, [&](ddp::Environment e) {
        const Result r = run(e, which);
        if (e.rank != 0) return;
        std::FILE* f = std::fopen(file.c_str(), "wb");
        if (f == nullptr) return;
        std::fwrite(&r, sizeof r, 1, f);
        std::fclose(f);
      });
      Result r;
      std::FILE* f = std::fopen(file.c_str(), "rb");
      if (f == nullptr || std::fread(&r, sizeof r, 1, f) != 1) {
        std::fprintf(stderr, "gradient-bench: no result from round %d\n", round);
        return false;
      }
      std::fclose(f);
      std::remove(file.c_str());
      (which ? second : first).push_back(r);
    }
  }
  return true;
}

int zero_rounds(int nproc, int reps, int rounds) {
  std::vector<ZeroResult> full, zero;
  if (!alternating_rounds(
          nproc, rounds, "zero",
          [&](ddp::Environment e, bool sharded) { return run_zero(e, reps, sharded); }, full, zero))
    return 1;
  fmt::print(
      "# ResNet-50 (25.6 M floats) with Adam, {} ranks: GradientAverager against ShardedAverager, "
      "{} rounds (median of {} steps each)\n",
      nproc, rounds, reps);
  fmt::print(
      "| round | step ms: averager / sharded | ratio | communication ms: all_reduce / "
      "reduce_scatter + all_gather | ratio | reduction exposed after backward ({}), ms: "
      "all_reduce / reduce_scatter | peak RSS MB: averager / sharded | Adam state MB per rank "
      "|\n|---|---|---:|---|---:|---|---|---|\n",
      g_sleep ? "sleep" : "spin");
  std::vector<double> step_ratio, comm_ratio, peak_ratio;
  for (int i = 0; i < rounds; ++i) {
    const auto& a = full[static_cast<std::size_t>(i)];
    const auto& b = zero[static_cast<std::size_t>(i)];
    step_ratio.push_back(a.step_us / b.step_us);
    comm_ratio.push_back(a.comm_us / b.comm_us);
    peak_ratio.push_back(b.peak_mb / a.peak_mb);
    fmt::print(
        "| {} | {:.1f} / {:.1f} | {:.2f}x | {:.1f} / {:.1f} | {:.2f}x | {:.1f} / {:.1f} | {:.0f} / "
        "{:.0f} | {:.0f} / {:.0f} |\n",
        i + 1, a.step_us / 1e3, b.step_us / 1e3, step_ratio.back(), a.comm_us / 1e3,
        b.comm_us / 1e3, comm_ratio.back(), a.exposed_us / 1e3, b.exposed_us / 1e3, a.peak_mb,
        b.peak_mb, a.state_mb, b.state_mb);
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  fmt::print(
      "\n# medians: step time averager / sharded {:.2f}x, communication {:.2f}x, peak memory "
      "sharded / averager {:.2f}\n",
      median(step_ratio), median(comm_ratio), median(peak_ratio));
  return 0;
}

// ---- --mirror: ShardedAverager's steps with and without an in-memory copy of each shard ----

struct MirrorResult {
  double step_us = 0;  // a step (average, Adam on the shard, gather; and the mirror's save)
  double save_us = 0;  // the mirror's save alone
  double file_us =
      0;  // a sharded checkpoint's save to disk (ShardedAverager::save(path)), for scale
  double state_mb = 0;   // Adam's moments and the shard's values on one rank
  double mirror_mb = 0;  // what the mirror holds on one rank
  double load_ms = 0;    // after the last rank leaves: the survivors' shrink, averager, load
};

MirrorResult run_mirror(ddp::Environment env, int reps, bool mirrored) {
  auto comm = Comm::init(env);
  std::vector<Param> model;
  for (std::size_t n : resnet50_sizes())
    model.push_back({std::vector<float>(n, 0.01f),
                     std::vector<float>(n, 1.0f + static_cast<float>(comm.rank()))});
  ddp::ShardMirror mirror;
  std::optional<ddp::ShardedAverager<std::vector<Param>, ddp::backend::Host>> zero;
  zero.emplace(comm, model);
  std::vector<float> m, s;  // Adam's moments over the shard, in shard() order
  m.assign(zero->shard_size(), 0.0f);
  s.assign(zero->shard_size(), 0.0f);
  int t = 0;
  const auto save = [&] {
    ddp::Checkpoint state;
    state.put_sharded("m", m, zero->layout()).put_sharded("v", s, zero->layout());
    state.put_object("t", t);
    zero->save(state, mirror, static_cast<std::uint64_t>(t));
  };
  MirrorResult r;
  r.step_us = measure(comm, reps, [&] {
    zero->step([&](std::span<ddp::ShardSlice<float>> shard) {
      ++t;
      std::size_t at = 0;
      for (auto& sl : shard) {
        adam(sl.value.data, sl.grad.data, m.data() + at, s.data() + at, sl.value.size, t);
        at += sl.value.size;
      }
    });
    if (mirrored) save();
  });
  r.save_us = measure(comm, reps, save);
  if (mirrored) {  // the same state to a sharded checkpoint on disk, each rank its file
    const std::string path = "/tmp/gradient-bench-ckpt." + std::to_string(::getppid());
    r.file_us = measure(comm, std::max(1, reps / 2), [&] {
      ddp::Checkpoint state;
      state.put_sharded("m", m, zero->layout()).put_sharded("v", s, zero->layout());
      (void)zero->save(state, path);
    });
    for (const auto& f : std::filesystem::directory_iterator("/tmp"))
      if (f.path().string().rfind(path, 0) == 0) std::filesystem::remove(f.path());
  }
  r.state_mb = 3.0 * static_cast<double>(zero->shard_size()) * 4 / 1e6;
  r.mirror_mb = static_cast<double>(mirror.bytes()) / 1e6;
  if (mirrored && comm.size() > 1) {
    const int last = comm.size() - 1;
    if (comm.rank() == last) {
      comm.barrier();
      return r;  // leaves the job; the others go on without it
    }
    comm.barrier();
    const auto start = Clock::now();
    comm = comm.shrink({.exclude = {last}});
    zero.emplace(comm, model);
    const auto ck = zero->load(mirror);

    if (!ck) throw std::runtime_error("no save in the mirror");
    r.load_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }
  return r;
}

int mirror_rounds(int nproc, int reps, int rounds) {
  std::vector<MirrorResult> plain, mirrored;
  if (!alternating_rounds(
          nproc, rounds, "mirror",
          [&](ddp::Environment e, bool with) { return run_mirror(e, reps, with); }, plain,
          mirrored))
    return 1;
  fmt::print(
      "# ResNet-50 (25.6 M floats) with Adam on ShardedAverager, {} ranks: steps without and "
      "with ShardedAverager::save(mirror) after each, {} rounds (median of {} steps each)\n",
      nproc, rounds, reps);
  fmt::print(
      "| round | step ms: plain / mirrored | ratio | mirror save ms | sharded checkpoint to disk "
      "ms | shard state MB per rank (values + Adam) | mirror MB per rank | recovery ms (shrink + "
      "averager + load) |\n|---|---|---:|---:|---:|---:|---:|---:|\n");
  std::vector<double> ratio, save_ms, load_ms;
  for (int i = 0; i < rounds; ++i) {
    const auto& a = plain[static_cast<std::size_t>(i)];
    const auto& b = mirrored[static_cast<std::size_t>(i)];
    ratio.push_back(b.step_us / a.step_us);
    save_ms.push_back(b.save_us / 1e3);
    load_ms.push_back(b.load_ms);
    fmt::print("| {} | {:.1f} / {:.1f} | {:.2f}x | {:.1f} | {:.1f} | {:.0f} | {:.0f} | {:.1f} |\n",
               i + 1, a.step_us / 1e3, b.step_us / 1e3, ratio.back(), save_ms.back(),
               b.file_us / 1e3, b.state_mb, b.mirror_mb, b.load_ms);
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  fmt::print(
      "\n# medians: step time mirrored / plain {:.2f}x, save {:.1f} ms, recovery {:.1f} ms; "
      "mirror memory {:.1f}x the shard state\n",
      median(ratio), median(save_ms), median(load_ms),
      mirrored.front().mirror_mb / mirrored.front().state_mb);
  return 0;
}

// --timeline: the timeline's cost, recording on against off, in alternating rounds.
void timeline_rounds(ddp::Environment env, int reps, int rounds) {
  const std::string dir = (std::filesystem::temp_directory_path() /
                           ("ddp-bench-timeline-" + std::to_string(::getppid())))
                              .string();
  auto comm = Comm::init(env, {.timeline = dir});
  std::vector<Param> model;
  std::size_t floats = 0;
  for (std::size_t n : resnet50_sizes()) {
    model.push_back({std::vector<float>(n, 0.01f), std::vector<float>(n, 1.0f)});
    floats += n;
  }
  ddp::GradientAverager avg(comm, model, {.bucket_bytes = std::size_t{1} << 20});
  auto& timeline = ddp::detail::Timeline::get();
  const double compute_total = 20000;  // 20 ms of backward on this core
  const auto step = [&] {
    for (std::size_t i = model.size(); i-- > 0;) {
      compute_for(compute_total * static_cast<double>(model[i].grad.size()) /
                  static_cast<double>(floats));
      avg.mark_ready(i);
    }
    avg.synchronize();
  };
  const auto per_tensor = [&] {
    for (auto& p : model) comm.all_reduce(p.grad, ddp::ReduceOp::avg);
  };
  std::vector<double> step_ratio, tensor_ratio;
  double step_on = 0, step_off = 0;
  for (int round = 0; round < rounds; ++round) {
    double on[2] = {}, off[2] = {};
    for (int k = 0; k < 2; ++k) {
      const bool recording = (round + k) % 2 == 0;
      timeline.set_recording(recording);
      const double a = measure(comm, reps, step), b = measure(comm, reps, per_tensor);
      (recording ? on : off)[0] = a;
      (recording ? on : off)[1] = b;
    }
    step_ratio.push_back(on[0] / off[0]);
    tensor_ratio.push_back(on[1] / off[1]);
    step_on += on[0] / rounds;
    step_off += off[0] / rounds;
  }
  timeline.set_recording(true);
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  if (comm.rank() == 0) {
    fmt::print(
        "# the timeline's cost: {} ranks ({}), {} rounds of {} steps, recorded and not in "
        "alternating order\n",
        comm.size(), comm.backend().transport(), rounds, reps);
    fmt::print("| workload | median of per-round on/off | rounds |\n|---|---:|---|\n");
    const auto row = [&](const char* name, const std::vector<double>& r) {
      std::string all;
      for (double x : r) all += fmt::format("{}{:.3f}", all.empty() ? "" : " ", x);
      fmt::print("| {} | {:.3f} | {} |\n", name, median(r), all);
    };
    row("training step: GradientAverager (1 MiB buckets), 20 ms backward", step_ratio);
    row("161 per-tensor all_reduces", tensor_ratio);
    fmt::print("step time: {:.2f} ms recorded, {:.2f} ms not (means of the rounds' medians)\n",
               step_on / 1e3, step_off / 1e3);
  }
  // What one span costs this process, recorded and not: a collective's (three numeric args).
  if (comm.rank() == 0) {
    const auto per_span = [&](bool recording) {
      timeline.set_recording(recording);
      constexpr int n = 200000;
      const double t0 = now_us();
      for (int i = 0; i < n; ++i) {
        ddp::detail::TimelineScope span(2, "all_reduce", "collective");
        if (span.on()) {
          span.arg("seq", i);
          span.arg("bytes", std::int64_t{1} << 20);
          span.arg("queued_us", 3);
        }
      }
      return (now_us() - t0) * 1e3 / n;
    };
    const double on = per_span(true), off = per_span(false);
    timeline.set_recording(true);
    fmt::print("one span: {:.0f} ns recorded, {:.1f} ns not\n", on, off);
  }
  comm.barrier();
  if (comm.rank() == 0) std::filesystem::remove_all(dir);
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
  int zero = 0;
  app.add_option("--zero", zero,
                 "ShardedAverager against GradientAverager with Adam: this many rounds");
  int timeline = 0;
  app.add_option("--timeline", timeline,
                 "the timeline's cost, recording on against off: this many rounds");
  int mirror = 0;
  app.add_option("--mirror", mirror,
                 "ShardedAverager steps without and with an in-memory copy of each shard "
                 "(ShardMirror): this many rounds");
  CLI11_PARSE(app, argc, argv);
  g_sleep = compute == "sleep";
  if (mirror > 0) {
    try {
      return mirror_rounds(nproc, reps, mirror);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gradient-bench: %s\n", e.what());
      return 1;
    }
  }
  if (zero > 0) {
    try {
      return zero_rounds(nproc, reps, zero);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gradient-bench: %s\n", e.what());
      return 1;
    }
  }
  const auto env = ddp::Environment::detect();
  if (timeline > 0) {
    try {
      if (env.launcher == "none")
        ddp::spawn(nproc, [&](ddp::Environment e) { timeline_rounds(e, reps, timeline); });
      else
        timeline_rounds(env, reps, timeline);
      return 0;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "gradient-bench: %s\n", e.what());
      return 1;
    }
  }
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
