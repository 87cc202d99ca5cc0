// checkpoint-bench: what saving a checkpoint every N steps costs a training loop, synchronous
// (Checkpoint::save) against asynchronous (ddp::AsyncSaver), beside no checkpoint at all.
//
//   build/release/bench/checkpoint-bench --mb 100 --every 10 --steps 30 --rounds 5
//
// A step is --step-ms of arithmetic on this core (the training). Every --every steps the loop
// takes a snapshot of a --mb MB model (Checkpoint::put_values: the copy any save needs) and saves
// it to --dir: synchronously, with AsyncSaver::save(std::move(ck)) (a new Checkpoint each time),
// and with AsyncSaver::next() (the saver's checkpoint, its memory reused). Each round runs the
// loops in an order that rotates from round to round; the figures are the medians of the per-round
// ratios of the mean step time to the loop without checkpoints.
#include <ddp/ddp.hpp>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

volatile double g_sink = 0;
void compute_for(double ms) {
  const double until = now_ms() + ms;
  double x = 1;
  while (now_ms() < until)
    for (int k = 0; k < 256; ++k) x = x * 1.0000001 + 1e-9;
  g_sink = x;
}

enum class Mode { none, sync, async, reused };

// The mean step time (ms) of `steps` steps saving in `mode` every `every` steps.
double run(Mode mode, std::vector<float>& model, int steps, int every, double step_ms,
           const std::string& path) {
  ddp::AsyncSaver saver;
  const double t0 = now_ms();
  for (int step = 1; step <= steps; ++step) {
    compute_for(step_ms);
    for (std::size_t i = 0; i < model.size(); i += 4096) model[i] += 1.0f;  // the update
    if (mode == Mode::none || step % every != 0) continue;
    if (mode == Mode::reused) {  // the saver's own checkpoint: its memory reused
      ddp::Checkpoint& next = saver.next();
      next.put_values("model", model);
      next.put_object("step", step);
      saver.save(path);
      continue;
    }
    ddp::Checkpoint ck;
    ck.put_values("model", model);
    ck.put_object("step", step);
    if (mode == Mode::sync)
      ck.save(path);
    else
      saver.save(std::move(ck), path);
  }
  const double mean = (now_ms() - t0) / steps;
  saver.wait();  // after the measured steps: the last write is not a step's cost
  return mean;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"checkpoint-bench: a checkpoint every N steps, synchronous against asynchronous"};
  int mb = 100, every = 10, steps = 30, rounds = 5;
  double step_ms = 50;
  std::string dir = std::filesystem::temp_directory_path().string();
  app.add_option("--mb", mb, "the model's size in MB (float32)");
  app.add_option("--every", every, "steps between checkpoints");
  app.add_option("--steps", steps, "steps per measured loop");
  app.add_option("--rounds", rounds, "rounds (each runs the three loops)");
  app.add_option("--step-ms", step_ms, "a step's computation, in ms");
  app.add_option("--dir", dir, "where the checkpoints go");
  CLI11_PARSE(app, argc, argv);
  std::vector<float> model(static_cast<std::size_t>(mb) * 1000000 / sizeof(float), 0.5f);
  const std::string path = dir + "/checkpoint-bench-" + std::to_string(::getpid()) + ".ckpt";
  std::vector<double> sync_ratio, async_ratio, reused_ratio, none_ms, sync_ms, async_ms, reused_ms;
  try {
    (void)run(Mode::async, model, every, every, step_ms, path);  // warm: the file, the cache
    for (int round = 0; round < rounds; ++round) {
      double t[4] = {};
      for (int k = 0; k < 4; ++k) {
        const int m = (round + k) % 4;
        t[m] = run(static_cast<Mode>(m), model, steps, every, step_ms, path);
      }
      none_ms.push_back(t[0]);
      sync_ms.push_back(t[1]);
      async_ms.push_back(t[2]);
      sync_ratio.push_back(t[1] / t[0]);
      async_ratio.push_back(t[2] / t[0]);
      reused_ms.push_back(t[3]);
      reused_ratio.push_back(t[3] / t[0]);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint-bench: %s\n", e.what());
    std::filesystem::remove(path);
    return 1;
  }
  std::filesystem::remove(path);
  // What bounds the background loop: the snapshot on the training thread (a copy of the model
  // into a new Checkpoint: fresh memory, page faults included), and the write's own time.
  std::vector<double> snapshot_ms, write_ms;
  for (int k = 0; k < 5; ++k) {
    const double t0 = now_ms();
    ddp::Checkpoint ck;
    ck.put_values("model", model);
    const double t1 = now_ms();
    ck.save(path);
    snapshot_ms.push_back(t1 - t0);
    write_ms.push_back(now_ms() - t1);
  }
  std::filesystem::remove(path);
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  fmt::print(
      "# a {} MB checkpoint every {} steps of {:.0f} ms, {} steps a loop, {} rounds, in {}\n", mb,
      every, step_ms, steps, rounds, dir);
  fmt::print("| loop | step (ms, median) | step / no checkpoint (median of rounds) |\n");
  fmt::print("|---|---:|---:|\n");
  fmt::print("| no checkpoint | {:.2f} | 1.000 |\n", median(none_ms));
  fmt::print("| Checkpoint::save (synchronous) | {:.2f} | {:.3f} |\n", median(sync_ms),
             median(sync_ratio));
  fmt::print("| AsyncSaver::save(std::move(ck)), a new Checkpoint each time | {:.2f} | {:.3f} |\n",
             median(async_ms), median(async_ratio));
  fmt::print("| AsyncSaver, its own checkpoint reused (next(), save(path)) | {:.2f} | {:.3f} |\n",
             median(reused_ms), median(reused_ratio));
  fmt::print(
      "snapshot (put_values of the model into a new Checkpoint): {:.1f} ms; the save's "
      "write alone (Checkpoint::save): {:.1f} ms (medians of 5)\n",
      median(snapshot_ms), median(write_ms));
  return 0;
}
