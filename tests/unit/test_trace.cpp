// The flight recorder across real processes: the states of the operations it holds, recent(),
// the dumps a timeout writes on every rank (and under spawn with DDP_TRACE_DUMP), where a dump
// never goes, and tools/trace_diagnose.hpp reading dumps back and comparing them.
#include "failure_helpers.hpp"
#include "multiprocess.hpp"
#include "trace_diagnose.hpp"  // tools/: parse_trace, read_trace_dumps, diagnose_traces

#include <ddp/trace.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

TEST_CASE("flight recorder: an operation in progress is running, one behind it queued") {
  ddp::Options o;
  o.timeout = std::chrono::seconds(20);
  o.group = "recorder-states";
  run_faulty(
      2, ddp::HostTransport::shm,
      [&](Comm& comm) {
        std::vector<float> v(16, 1.0f);
        if (comm.rank() == 1) {  // late: rank 0's all_reduce waits for it
          std::this_thread::sleep_for(std::chrono::milliseconds(1000));
          comm.all_reduce(v);
          comm.barrier();
          return;
        }
        using St = ddp::TraceRecord::State;
        const auto state_of = [&](std::uint64_t seq) -> std::optional<St> {
          for (const auto& r : comm.recent())
            if (r.seq == seq) return r.state;
          return std::nullopt;
        };
        std::optional<St> seen_running, seen_queued;
        std::thread watcher([&] {
          const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
          while (state_of(0) != St::running && std::chrono::steady_clock::now() < until)
            std::this_thread::yield();
          seen_running = state_of(0);
          auto work = comm.barrier_async();  // behind the all_reduce that runs
          seen_queued = state_of(1);
          work.wait();
        });
        comm.all_reduce(v);  // inline: recorded as running at once
        watcher.join();
        MP_EXPECT(seen_running == St::running, "the all_reduce in progress");
        MP_EXPECT(seen_queued == St::queued, "the barrier behind it");
        MP_EXPECT(state_of(0) == St::done && state_of(1) == St::done, "both done");
        MP_EXPECT(v[0] == 2.0f, v[0]);
      },
      o);
}

TEST_CASE("flight recorder: recent() lists the operations, a timeout dumps them on every rank") {
  for (const mp::Path& t : mp::paths()) {
    CAPTURE(mp::name(t));
    mp::TempDir dir;
    ddp::Options o;
    o.timeout = std::chrono::milliseconds(700);
    o.trace_entries = 8;
    o.trace_dump = dir.path;
    o.group = "flight";
    run_faulty(
        3, t,
        [&](Comm& comm) {
          std::vector<float> v(1000, 1.0f);
          std::vector<double> w(10);
          for (int i = 0; i < 5; ++i) comm.all_reduce(v);
          comm.broadcast(w, 0);
          auto work = comm.barrier_async();
          work.wait();
          const auto recent = comm.recent();
          MP_EXPECT(recent.size() == 7, recent.size() << " records");
          MP_EXPECT(recent.front().seq == 0 && recent.back().seq == 6, "seq");
          MP_EXPECT(std::string(recent[0].op) == "all_reduce" && recent[0].bytes == 4000,
                    recent[0].op << " " << recent[0].bytes);
          MP_EXPECT(std::string(recent[5].op) == "broadcast" && recent[5].bytes == 80, "broadcast");
          MP_EXPECT(std::string(recent[6].op) == "barrier", "barrier");
          for (const auto& r : recent) MP_EXPECT(r.state == ddp::TraceRecord::State::done, r.seq);
          // Rank 2 falls behind: it skips two all_reduces and sleeps past the timeout.
          if (comm.rank() == 2) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));
            return;
          }
          try {
            comm.all_reduce(v);
            comm.all_reduce(v);
          } catch (const ddp::Error& e) {
            report(dir, comm.rank(), e, 0);
            const auto after = comm.recent();
            MP_EXPECT(after.size() == 8 && after.front().seq == 0 && after.back().seq == 7,
                      after.size() << " records, last #" << after.back().seq);
            MP_EXPECT(after.back().state == ddp::TraceRecord::State::failed, "state");
            MP_EXPECT(comm.trace().find("all_reduce") != std::string::npos, comm.trace());
            // Calls on the poisoned communicator fail at once (an async one on wait()) and
            // leave the recorder alone: it keeps the operation that failed.
            for (int k = 0; k < 20; ++k) {
              try {
                if (k % 2 == 0)
                  comm.all_reduce(v);
                else
                  comm.broadcast_async(w, 0).wait();
                MP_EXPECT(false, "a poisoned communicator ran an operation");
              } catch (const ddp::Error& again) {
                MP_EXPECT(again.code() == ddp::Errc::aborted, again.what());
              }
            }
            MP_EXPECT(comm.recent().back().seq == 7, "last #" << comm.recent().back().seq);
          }
        },
        o);
    for (int r : {0, 1}) {
      const Outcome out = read_outcome(dir, r);
      CAPTURE(r);
      CAPTURE(out.message);
      CHECK(out.code == "timeout");
      CHECK(out.message.find("rank 2") != std::string::npos);
      const std::string dump =
          mp::TempDir::read(dir.file("ddp-trace-flight-rank" + std::to_string(r) + ".txt"));
      CAPTURE(dump);
      CHECK(dump.find("ddp flight recorder: rank " + std::to_string(r) +
                      " of 3, group \"flight\", the last 8 of 8 operations") != std::string::npos);
      CHECK(dump.find("dumped because: rank " + std::to_string(r)) != std::string::npos);
      CHECK(dump.find("rank 2") != std::string::npos);  // the lagging rank, from the message
      CHECK(dump.find("         7  all_reduce                     4000  failed") !=
            std::string::npos);
      CHECK(dump.find("         5  broadcast                        80  done") !=
            std::string::npos);
    }
    CHECK(mp::TempDir::read(dir.file("ddp-trace-flight-rank2.txt")).empty());  // no timeout there
    // The dumps read back and compared name rank 2.
    const auto dumps = ddp::read_trace_dumps(dir.path);
    REQUIRE(dumps.size() == 2);
    CHECK(dumps[0].rank == 0);
    CHECK(dumps[1].rank == 1);
    CHECK(dumps[0].position() == 7);
    const std::string report = ddp::diagnose_traces(dumps);
    CAPTURE(report);
    CHECK(report.find("group \"flight\": dumps from 2 of 3 ranks") != std::string::npos);
    CHECK(report.find("rank 0: at #7 all_reduce (4000 B, failed), 8 issued") != std::string::npos);
    CHECK(report.find("no dump: rank 2") != std::string::npos);
    CHECK(report.find("lagging: rank 2\n") != std::string::npos);
  }
}

TEST_CASE("spawn with DDP_TRACE_DUMP: failing ranks all write their dumps before the stop") {
  // Ranks 0, 1 and 3 time out waiting for rank 2 and let the error propagate: spawn stops the
  // others after the first failure, but only after a second, so every waiting rank's dump is
  // written; rank 2, which sleeps, is stopped well before its 20 s.
  mp::TempDir tmp;
  const std::string dir = tmp.path + "/dumps/job1";  // made on demand, parents too
  ::setenv("DDP_TRACE_DUMP", dir.c_str(), 1);
  ddp::Options o;
  o.timeout = std::chrono::milliseconds(500);
  o.transport = ddp::HostTransport::shm;
  o.segment_bytes = mp::test_segment;
  const auto t0 = Clock::now();
  std::string error;
  try {
    ddp::spawn(4, [&](ddp::Environment env) {
      auto comm = Comm::init(env, o);
      std::vector<float> v(16, 1.0f);
      comm.all_reduce(v);
      if (comm.rank() == 2) {
        std::this_thread::sleep_for(std::chrono::seconds(20));
        return;
      }
      comm.all_reduce(v);
    });
  } catch (const ddp::Error& e) {
    error = e.what();
  }
  ::unsetenv("DDP_TRACE_DUMP");
  CAPTURE(error);
  CHECK(error.find("spawn: rank ") != std::string::npos);
  CHECK(mp::ms_since(t0) < 10000);
  const auto dumps = ddp::read_trace_dumps(dir);
  REQUIRE(dumps.size() == 3);
  CHECK(dumps[0].rank == 0);
  CHECK(dumps[1].rank == 1);
  CHECK(dumps[2].rank == 3);
  const std::string report = ddp::diagnose_traces(dumps);
  CAPTURE(report);
  CHECK(report.find("lagging: rank 2\n") != std::string::npos);
}

TEST_CASE("a FIFO or a link where the flight recorder goes: never waited on, never followed") {
  mp::TempDir dir;
  const std::string fifo = dir.file("ddp-trace-g-rank0.txt"),
                    link = dir.file("ddp-trace-g-rank1.txt");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  mp::TempDir::write(dir.file("victim"), "precious");
  REQUIRE(::symlink(dir.file("victim").c_str(), link.c_str()) == 0);
  const auto t0 = Clock::now();
  ddp::detail::dump_trace(dir.path, "the trace\n", "g", 0);  // to stderr instead
  ddp::detail::dump_trace(dir.path, "the trace\n", "g", 1);
  CHECK(mp::ms_since(t0) < 2000);
  CHECK(mp::TempDir::read(dir.file("victim")) == "precious");
}

TEST_CASE("parse_trace reads format_trace back, refuses other text, diagnose_traces compares") {
  using State = ddp::TraceRecord::State;
  const auto dump = [](int rank, std::vector<ddp::TraceRecord> records, std::uint64_t issued,
                       const char* group = "g") {
    return ddp::parse_trace(ddp::detail::format_trace(records, issued, rank, 4, group,
                                                      "rank 0: timed out, \"quoted\""));
  };
  const auto rec = [](std::uint64_t seq, const char* op, std::size_t bytes, State st) {
    return ddp::TraceRecord{seq, op, bytes, st, std::chrono::steady_clock::now()};
  };
  const ddp::TraceDump d =
      dump(1, {rec(8, "broadcast", 80, State::done), rec(9, "all_reduce", 4, State::failed)}, 10,
           "my \"group\"");
  CHECK(d.rank == 1);
  CHECK(d.size == 4);
  CHECK(d.group == "my \"group\"");
  CHECK(d.issued == 10);
  CHECK(d.why == "rank 0: timed out, \"quoted\"");
  REQUIRE(d.entries.size() == 2);
  CHECK(d.entries[0].seq == 8);
  CHECK(d.entries[0].op == "broadcast");
  CHECK(d.entries[0].bytes == 80);
  CHECK(d.entries[1].state == State::failed);
  CHECK(d.position() == 9);

  for (const char* bad :
       {"", "hello\n",
        "ddp flight recorder: rank x of 4, group \"g\", the last 0 of 0 operations\n",
        "ddp flight recorder: rank 5 of 4, group \"g\", the last 0 of 0 operations\n",
        "ddp flight recorder: rank 0 of 4, group \"g\", the last 1 of 1 operations\ntitles\n",
        "ddp flight recorder: rank 0 of 4, group \"g\", the last 1 of 1 operations\ntitles\n"
        "  0 all_reduce 4 sleeping 3\n"}) {
    CAPTURE(std::string(bad));
    try {
      (void)ddp::parse_trace(bad, "f.txt");
      FAIL("accepted");
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::invalid_argument);
      CHECK(std::string(e.what()).find("f.txt: not a ddp flight recorder dump") !=
            std::string::npos);
    }
  }

  try {
    (void)ddp::read_trace_file("/nonexistent/ddp-trace-x-rank0.txt");
    FAIL("read a file that does not exist");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::system);
    CHECK(std::string(e.what()).find("/nonexistent/ddp-trace-x-rank0.txt: cannot open") !=
          std::string::npos);
  }

  // Rank 3 is stuck one operation behind ranks 0 and 1; rank 2 left no dump.
  const std::vector<ddp::TraceDump> lag = {
      dump(0, {rec(4, "all_reduce", 4, State::done), rec(5, "broadcast", 8, State::failed)}, 6),
      dump(1, {rec(4, "all_reduce", 4, State::done), rec(5, "broadcast", 8, State::failed)}, 6),
      dump(3, {rec(4, "all_reduce", 4, State::failed)}, 5)};
  std::string report = ddp::diagnose_traces(lag);
  CAPTURE(report);
  CHECK(report.find("dumps from 3 of 4 ranks") != std::string::npos);
  CHECK(report.find("rank 3: at #4 all_reduce (4 B, failed), 5 issued") != std::string::npos);
  CHECK(report.find("behind: rank 3 (the others reached #5)") != std::string::npos);
  CHECK(report.find("no dump: rank 2") != std::string::npos);
  CHECK(report.find("lagging: ranks 2, 3\n") != std::string::npos);

  // Every rank in #5, but they called different collectives (verify_collectives off).
  std::vector<ddp::TraceDump> differ;
  for (int r = 0; r < 4; ++r)
    differ.push_back(dump(r, {rec(5, r == 2 ? "reduce" : "broadcast", 8, State::failed)}, 6));
  report = ddp::diagnose_traces(differ);
  CHECK(report.find("ranks disagree on #5: rank 0 called broadcast, rank 2 called reduce") !=
        std::string::npos);
  CHECK(report.find("lagging") == std::string::npos);

  // Every rank in the same operation: nobody lags.
  differ[2] = dump(2, {rec(5, "broadcast", 8, State::failed)}, 6);
  report = ddp::diagnose_traces(differ);
  CHECK(report.find("every rank reached #5; none lags") != std::string::npos);
}
