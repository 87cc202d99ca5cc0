// Metrics across real processes: sums, weighted means, minima and maxima reduced in one
// collective; disagreeing ranks, unknown names and changed kinds refused.
#include <ddp/observe/metrics.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "multiprocess.hpp"

TEST_CASE("training: Metrics reduces sums, weighted means, minima and maxima in one collective") {
  // Rank r records r + 1 batches: batch b has mean loss 0.1 * (r + b) + 1/3 over 10 * (b + 1)
  // samples, b correct answers, a step time of 5 + r - b ms. Rank 0 also records a mean of weight
  // 0.
  const auto loss = [](int r, int b) { return 0.1 * (r + b) + 1.0 / 3.0; };
  mp::each_world([&](mp::Comm& comm) {
    const int p = comm.size(), me = comm.rank();
    ddp::Metrics m;
    for (int b = 0; b <= me; ++b) {
      m.mean("loss", loss(me, b), 10.0 * (b + 1));
      m.sum("correct", b).sum("seen", 10.0 * (b + 1));
      m.min("fastest_ms", 5 + me - b).max("slowest_ms", 5 + me - b);
    }
    m.mean("unweighted", me == 0 ? 7.0 : 1.0, me == 0 ? 0.0 : 1.0);
    const ddp::MetricValues r = m.reduce(comm);
    // References, in rank order as reduce() combines them.
    double lw = 0, w = 0, correct = 0, seen = 0, fastest = 1e9, slowest = -1e9;
    for (int j = 0; j < p; ++j) {
      double jlw = 0, jw = 0, jc = 0, js = 0;
      for (int b = 0; b <= j; ++b) {
        jlw += loss(j, b) * (10.0 * (b + 1));
        jw += 10.0 * (b + 1);
        jc += b;
        js += 10.0 * (b + 1);
        fastest = std::min<double>(fastest, 5 + j - b);
        slowest = std::max<double>(slowest, 5 + j - b);
      }
      lw = j == 0 ? jlw : lw + jlw;
      w = j == 0 ? jw : w + jw;
      correct += jc;
      seen += js;
    }
    MP_EXPECT(r["loss"] == lw / w, r["loss"] << " != " << lw / w);
    MP_EXPECT(r.entry("loss").weight == w, r.entry("loss").weight);
    MP_EXPECT(r["correct"] == correct && r["seen"] == seen, r.format());
    MP_EXPECT(r["fastest_ms"] == fastest && r["slowest_ms"] == slowest, r.format());
    MP_EXPECT(p == 1 ? std::isnan(r["unweighted"]) : r["unweighted"] == 1.0, r.format());
    MP_EXPECT(r.size() == 6 && r.entries()[0].name == "loss", r.format());
    MP_EXPECT(r.format(3).rfind("loss ", 0) == 0, r.format(3));
    // The local view is this rank's alone; reset keeps the names.
    MP_EXPECT(m.local()["seen"] == 10.0 * (me + 1) * (me + 2) / 2, m.local().format());
    m.reset();
    m.sum("seen", 1);
    MP_EXPECT(m.reduce(comm)["seen"] == p, "after reset");
  });
}

TEST_CASE("training: Metrics refuses disagreeing ranks, unknown names and changed kinds") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    ddp::Metrics m;
    m.sum("a", 1);
    if (comm.rank() == 1)
      m.max("b", 2);
    else
      m.sum("b", 2);
    try {
      (void)m.reduce(comm);
      MP_EXPECT(false, "different kinds were reduced together");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
      const std::string other = comm.rank() == 1 ? "rank 0" : "rank 1";
      MP_EXPECT(std::string(e.what()).find(other + " recorded other metrics") != std::string::npos,
                e.what());
    }
    // The communicator is still usable: the failure was found after the collective.
    ddp::Metrics ok;
    ok.sum("x", comm.rank());
    const auto r = ok.reduce(comm);
    MP_EXPECT(r["x"] == 3.0, r["x"]);
    try {
      (void)r["y"];
      MP_EXPECT(false, "an unknown name was found");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument &&
                    std::string(e.what()).find("no metric named \"y\" (recorded: x)") !=
                        std::string::npos,
                e.what());
    }
    try {
      ok.max("x", 1);
      MP_EXPECT(false, "a kind changed");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
    }
    try {
      ok.mean("m", 1.0, -1.0);
      MP_EXPECT(false, "a negative weight was taken");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
    }
  });
}
