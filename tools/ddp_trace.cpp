// ddp-trace: reads the flight-recorder dumps of a job's ranks and names the rank that fell behind.
//
//   DDP_TRACE_DUMP=/tmp/traces ddprun --nproc-per-node 4 ./train     # a timeout writes the dumps
//   ddp-trace /tmp/traces                                             # who lagged, and where
//
// Arguments are dump files or directories (every ddp-trace-*.txt in them). Exit status: 0 when
// dumps were read, 1 when none were found or one could not be read.
#include <ddp/ddp.hpp>

#include "trace_diagnose.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  CLI::App app{"ddp-trace: which rank fell behind, from the ranks' flight-recorder dumps"};
  std::vector<std::string> paths;
  bool verbose = false;
  app.add_option("paths", paths, "dump files, or directories holding ddp-trace-*.txt")->required();
  app.add_flag("-v,--verbose", verbose, "also print each dump's last records");
  CLI11_PARSE(app, argc, argv);
  std::vector<ddp::TraceDump> dumps;
  try {
    for (const auto& p : paths) {
      std::error_code ec;
      if (fs::is_directory(p, ec)) {
        auto found = ddp::read_trace_dumps(p);
        dumps.insert(dumps.end(), found.begin(), found.end());
        continue;
      }
      dumps.push_back(ddp::read_trace_file(p));
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "ddp-trace: {}\n", e.what());
    return 1;
  }
  if (dumps.empty()) {
    fmt::print(stderr,
               "ddp-trace: no flight recorder dump (ddp-trace-*.txt) in {}; a communicator writes "
               "one when an operation times out and DDP_TRACE_DUMP names a directory\n",
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
