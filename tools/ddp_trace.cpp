// ddp-trace: reads the flight-recorder dumps of a job's ranks and names the rank that fell behind;
// or reads the ranks' timelines, merges them into one trace and draws a step.
//
//   DDP_TRACE_DUMP=/tmp/traces ddprun --nproc-per-node 4 ./train     # a timeout writes the dumps
//   ddp-trace /tmp/traces                                             # who lagged, and where
//
//   DDP_TIMELINE=/tmp/tl ddprun --nproc-per-node 4 ./train           # every rank's timeline
//   ddp-trace /tmp/tl            # /tmp/tl/ddp-timeline.json (open in ui.perfetto.dev) and
//                                # /tmp/tl/ddp-timeline-step.svg (the last step of every rank)
//
// Arguments are dump files or directories (every ddp-trace-*.txt in them), or timeline files or
// directories (ddp-timeline-rank*.json). Exit status: 0 when dumps or timelines were read, 1
// when none were found or one could not be read.
#include <ddp/ddp.hpp>

#include "timeline_view.hpp"
#include "trace_diagnose.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  CLI::App app{
      "ddp-trace: which rank fell behind, from the ranks' flight-recorder dumps; or the ranks' "
      "timelines merged into one trace, with a summary and a picture of a step"};
  std::vector<std::string> paths;
  bool verbose = false;
  std::string output, svg;
  std::string step_text;
  app.add_option("paths", paths,
                 "dump files or directories holding ddp-trace-*.txt; or timeline files or "
                 "directories holding ddp-timeline-rank*.json")
      ->required();
  app.add_flag("-v,--verbose", verbose, "also print each dump's last records");
  app.add_option("-o,--output", output,
                 "timelines: the merged trace (default: ddp-timeline.json beside the first)");
  app.add_option("--svg", svg,
                 "timelines: the picture of a step (default: ddp-timeline-step.svg beside the "
                 "first)");
  app.add_option("--step", step_text,
                 "timelines: the step to draw (default: the last every rank ran)")
      ->check([](const std::string& v) -> std::string {
        if (v.empty() || v.size() > 12 || v.find_first_not_of("0123456789") != std::string::npos)
          return "--step: \"" + v + "\" is not a step number (0, 1, 2, ...)";
        return {};
      });
  CLI11_PARSE(app, argc, argv);
  const long step = step_text.empty() ? -1 : std::stol(step_text);
  std::vector<ddp::TraceDump> dumps;
  std::vector<ddp::TimelineFile> timelines;
  std::vector<std::string> skipped;  // timeline files that could not be read
  std::string beside;                // where the timelines' outputs go by default
  try {
    for (const auto& p : paths) {
      std::error_code ec;
      if (fs::is_directory(p, ec)) {
        auto found = ddp::read_trace_dumps(p);
        dumps.insert(dumps.end(), found.begin(), found.end());
        auto lines = ddp::read_timelines(p, skipped);
        if (!lines.empty() && beside.empty()) beside = p;
        timelines.insert(timelines.end(), lines.begin(), lines.end());
        continue;
      }
      if (p.ends_with(".json")) {
        auto lines = ddp::read_timeline(p);
        timelines.insert(timelines.end(), lines.begin(), lines.end());
        if (beside.empty()) beside = fs::path(p).parent_path().string();
        continue;
      }
      dumps.push_back(ddp::read_trace_file(p));
    }
    for (const auto& why : skipped) fmt::print(stderr, "ddp-trace: left out: {}\n", why);
    if (!timelines.empty()) {
      std::vector<std::string> older;
      timelines = ddp::latest_run(std::move(timelines), older);
      if (!older.empty())
        fmt::print(stderr,
                   "ddp-trace: timelines of several runs here; the latest only, leaving out {}\n",
                   fmt::join(older, ", "));
      if (beside.empty()) beside = ".";
      if (output.empty()) output = beside + "/ddp-timeline.json";
      if (svg.empty()) svg = beside + "/ddp-timeline-step.svg";
      for (const auto& t : timelines) {
        if (t.repaired)
          fmt::print(stderr,
                     "ddp-trace: {} ends mid-event (its process was killed): read up to its last "
                     "complete event\n",
                     t.path);
      }
      std::ofstream(output) << ddp::merge_timelines(timelines);
      fmt::print(
          "{} ranks' timelines merged into {} (open it in ui.perfetto.dev or "
          "chrome://tracing)\n",
          timelines.size(), output);
      fmt::print("{}", ddp::format_steps(ddp::summarize_steps(timelines)));
      std::string picture;
      try {
        picture = ddp::draw_step(timelines, step);
      } catch (const ddp::Error& e) {
        fmt::print("no picture: {}\n", e.what());
        if (step >= 0) return 1;
      }
      if (!picture.empty()) {  // written only once drawn: a failed draw leaves the old one
        std::ofstream(svg) << picture;
        fmt::print("a step of every rank drawn in {}\n", svg);
      }
      if (dumps.empty()) return 0;
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "ddp-trace: {}\n", e.what());
    return 1;
  }
  if (dumps.empty()) {
    fmt::print(stderr,
               "ddp-trace: no flight recorder dump (ddp-trace-*.txt) and no timeline "
               "(ddp-timeline-rank*.json) in {}; a communicator writes a dump when an operation "
               "times out and DDP_TRACE_DUMP names a directory, a timeline when DDP_TIMELINE "
               "does\n",
               fmt::join(paths, ", "));
    return 1;
  }
  if (verbose) {
    for (const auto& d : dumps) {
      fmt::print("rank {} of {}, group \"{}\"{}{}\n", d.rank, d.size, d.group,
                 d.why.empty() ? "" : ", dumped because: ", d.why);
      const std::size_t from = d.entries.size() > 5 ? d.entries.size() - 5 : 0;
      for (std::size_t i = from; i < d.entries.size(); ++i) {
        const auto& e = d.entries[i];
        fmt::print("  #{} {} {} B {}\n", e.seq, e.op, e.bytes, ddp::to_string(e.state));
      }
    }
  }
  fmt::print("{}", ddp::diagnose_traces(dumps));
  return 0;
}
