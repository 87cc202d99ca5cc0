#include <ddp/training/checkpoint.hpp>
#include <ddp/training/gradient.hpp>
#include <ddp/training/guard.hpp>
#include <ddp/training/logging.hpp>
#include <ddp/training/metrics.hpp>
#include <ddp/training/sync_batch_norm.hpp>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "multiprocess.hpp"

static_assert(ddp::ProcessGroup<ddp::Communicator<ddp::backend::Host>>,
              "exact_mean and sync_batch_stats take any communicator");

TEST_CASE("training: sync_batch_stats equals the statistics of the whole batch") {
  // Rank r holds samples r*10 .. r*10 + r*3 - 1 of 2 channels (rank 0 holds none); channel 1 is
  // channel 0 times -2 plus 1000 (a large mean, a small spread).
  mp::each_world(
      [](mp::Comm& comm) {
        const auto value = [](int ch, int x) { return ch == 0 ? x * 0.5 : 1000.0 - x; };
        const int mine = comm.rank() * 3;
        std::vector<double> sum(2), sq(2);
        for (int k = 0; k < mine; ++k) {
          for (int ch = 0; ch < 2; ++ch) {
            const double v = value(ch, comm.rank() * 10 + k);
            sum[static_cast<std::size_t>(ch)] += v;
            sq[static_cast<std::size_t>(ch)] += v * v;
          }
        }
        const auto s = ddp::sync_batch_stats(comm, sum, sq, static_cast<std::uint64_t>(mine));
        // The reference, from every sample in one place (two-pass).
        std::vector<double> all[2];
        for (int r = 0; r < comm.size(); ++r)
          for (int k = 0; k < r * 3; ++k)
            for (int ch = 0; ch < 2; ++ch) all[ch].push_back(value(ch, r * 10 + k));
        MP_EXPECT(s.count == all[0].size(), "count " << s.count);
        for (int ch = 0; ch < 2; ++ch) {
          const auto& xs = all[ch];
          double mean = 0, m2 = 0;
          for (double x : xs) mean += x;
          mean = xs.empty() ? 0 : mean / static_cast<double>(xs.size());
          for (double x : xs) m2 += (x - mean) * (x - mean);
          const double var = xs.empty() ? 0 : m2 / static_cast<double>(xs.size());
          const double unbiased = xs.size() > 1 ? m2 / static_cast<double>(xs.size() - 1) : var;
          const auto c = static_cast<std::size_t>(ch);
          MP_EXPECT(std::abs(s.mean[c] - mean) <= 1e-12 * (1 + std::abs(mean)), "mean " << ch);
          MP_EXPECT(std::abs(s.var[c] - var) <= 1e-9 * (1 + var),
                    "var " << ch << ": " << s.var[c] << " vs " << var);
          MP_EXPECT(std::abs(s.unbiased_var[c] - unbiased) <= 1e-9 * (1 + unbiased),
                    "unbiased var " << ch);
        }
      },
      {1, 2, 3, 4});
}

TEST_CASE("training: sync_batch_stats with no samples anywhere, and mismatched inputs") {
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    const std::vector<float> zero(3, 0.0f);
    const auto s = ddp::sync_batch_stats(comm, zero, zero, 0);
    MP_EXPECT(s.count == 0 && s.mean == std::vector<double>(3, 0.0) &&
                  s.var == std::vector<double>(3, 0.0),
              "empty statistics");
    const std::vector<float> two(2, 1.0f);
    try {
      (void)ddp::sync_batch_stats(comm, zero, two, 1);
      MP_EXPECT(false, "no error for 3 sums and 2 sums of squares");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
      MP_EXPECT(std::string(e.what()).find("3 sums but 2 sums of squares") != std::string::npos,
                e.what());
    }
  });
}

namespace {

// A linear model y = W x + b (4 outputs, 8 inputs) plus a parameter the loss never uses.
struct Param {
  std::vector<float> value, grad;
};
struct Linear {
  static constexpr int in = 8, out = 4;
  std::vector<Param> params;
  Linear() {
    params.push_back({std::vector<float>(in * out), std::vector<float>(in * out)});
    params.push_back({std::vector<float>(out), std::vector<float>(out)});
    params.push_back({std::vector<float>(16), std::vector<float>(16)});
    for (std::size_t k = 0; k < params[0].value.size(); ++k)
      params[0].value[k] = 0.1f * std::sin(static_cast<float>(k));
  }
  std::vector<Param>& parameters() { return params; }
};

float feature(int sample, int i) {
  return std::sin(0.37f * static_cast<float>(sample) + static_cast<float>(i));
}
float target(int sample, int o) {
  return std::cos(0.11f * static_cast<float>(sample * (o + 1))) + 0.5f * static_cast<float>(o);
}

// Mean-squared-error gradients over samples [first, first + count), written into the grads.
void backward(Linear& m, int first, int count) {
  auto& w = m.params[0];
  auto& b = m.params[1];
  std::fill(w.grad.begin(), w.grad.end(), 0.0f);
  std::fill(b.grad.begin(), b.grad.end(), 0.0f);
  for (int s = first; s < first + count; ++s) {
    for (int o = 0; o < Linear::out; ++o) {
      float pred = b.value[static_cast<std::size_t>(o)];
      for (int i = 0; i < Linear::in; ++i)
        pred += w.value[static_cast<std::size_t>(o * Linear::in + i)] * feature(s, i);
      const float err = (pred - target(s, o)) / static_cast<float>(count);
      b.grad[static_cast<std::size_t>(o)] += err;
      for (int i = 0; i < Linear::in; ++i)
        w.grad[static_cast<std::size_t>(o * Linear::in + i)] += err * feature(s, i);
    }
  }
}

void sgd(Linear& m, float lr) {
  for (auto& p : m.params)
    for (std::size_t k = 0; k < p.value.size(); ++k) p.value[k] -= lr * p.grad[k];
}

constexpr int batch = 16, steps = 20;

// Data-parallel training: each rank takes its slice of every global batch.
Linear train(mp::Comm& comm, ddp::AveragerOptions options = {}) {
  Linear m;
  if (comm.rank() != 0) m.params[0].value.assign(m.params[0].value.size(), 9.0f);  // overwritten
  ddp::GradientAverager avg(comm, m, options);
  const int local = batch / comm.size();
  for (int step = 0; step < steps; ++step) {
    backward(m, step * batch + comm.rank() * local, local);
    avg.mark_ready(1);  // backward produces the last parameters' gradients first
    avg.mark_ready(0);
    avg.synchronize();
    sgd(m, 0.1f);
  }
  return m;
}

std::string bytes_of(const Linear& m) {
  std::string s;
  for (const auto& p : m.params)
    s.append(reinterpret_cast<const char*>(p.value.data()), p.value.size() * sizeof(float));
  return s;
}

}  // namespace

TEST_CASE("training: data-parallel SGD equals one process with the whole batch") {
  Linear ref;
  for (int step = 0; step < steps; ++step) {
    backward(ref, step * batch, batch);
    sgd(ref, 0.1f);
  }
  mp::TempDir dir;
  for (int world : {1, 2, 4}) {
    for (int run = 0; run < 2; ++run) {
      CAPTURE(world);
      mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {
        // Tiny buckets: several of them, launched as the gradients become ready.
        const Linear m = train(comm, {.bucket_bytes = 64, .first_bucket_bytes = 16});
        for (std::size_t p = 0; p < 2; ++p) {
          for (std::size_t k = 0; k < m.params[p].value.size(); ++k) {
            const double a = m.params[p].value[k], b = ref.params[p].value[k];
            MP_EXPECT(std::abs(a - b) <= 1e-6 * std::max(1.0, std::abs(b)),
                      "parameter " << p << "[" << k << "]: " << a << " vs " << b);
          }
        }
        const auto all = comm.all_gather_object(bytes_of(m));
        for (const auto& other : all)
          MP_EXPECT(other == all[0], "ranks ended with different models");
        if (comm.rank() == 0)
          mp::TempDir::write(dir.file("w" + std::to_string(world) + "r" + std::to_string(run)),
                             all[0]);
      });
    }
    // Two runs are bitwise identical.
    CHECK(mp::TempDir::read(dir.file("w" + std::to_string(world) + "r0")) ==
          mp::TempDir::read(dir.file("w" + std::to_string(world) + "r1")));
    CHECK(mp::TempDir::read(dir.file("w" + std::to_string(world) + "r0")).size() ==
          (32 + 4 + 16) * sizeof(float));
  }
}

TEST_CASE("training: buckets, no_sync accumulation, unused parameters, mismatches") {
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    Linear m;
    ddp::GradientAverager avg(comm, m, {.bucket_bytes = 64, .first_bucket_bytes = 16});
    // Reverse order; a first bucket of 16 bytes holds only the unused parameter (64 bytes).
    const auto buckets = avg.buckets();
    MP_EXPECT(buckets.size() == 3 && buckets[0] == std::vector<std::size_t>{2} &&
                  buckets[1] == std::vector<std::size_t>{1} &&
                  buckets[2] == std::vector<std::size_t>{0},
              "bucket layout");

    // no_sync: two micro-batches accumulate locally, then one average equals the sum of the two
    // global micro-batch gradients.
    {
      auto guard = avg.no_sync();
      backward(m, comm.rank() * 4, 4);
      avg.mark_ready(1);
      avg.average();  // ignored inside no_sync
    }
    auto first = m.params[0].grad;
    backward(m, 8 + comm.rank() * 4, 4);
    for (std::size_t k = 0; k < first.size(); ++k) m.params[0].grad[k] += first[k];
    avg.mark_ready(0);
    avg.mark_ready(1);
    // Parameter 2 is never marked on rank 1; rank 0 marks it with gradient 2: the average is 1.
    if (comm.rank() == 0) {
      m.params[2].grad.assign(16, 2.0f);
      avg.mark_ready(2);
    } else {
      m.params[2].grad.assign(16, 123.0f);  // not marked: counts as zero, and gets the average
    }
    avg.synchronize();
    Linear ref;
    backward(ref, 0, 8);
    auto g1 = ref.params[0].grad;
    backward(ref, 8, 8);
    for (std::size_t k = 0; k < g1.size(); ++k) {
      const double want = static_cast<double>(g1[k]) + ref.params[0].grad[k];
      MP_EXPECT(std::abs(m.params[0].grad[k] - want) <= 1e-6 * std::max(1.0, std::abs(want)),
                "accumulated gradient " << k);
    }
    for (float g : m.params[2].grad) MP_EXPECT(g == 1.0f, "unused parameter's average " << g);
    MP_EXPECT(!avg.found_nonfinite(), "finite gradients reported as non-finite");
    if (comm.rank() == 1) m.params[1].grad[2] = std::nanf("");
    avg.average();
    MP_EXPECT(avg.found_nonfinite(), "a NaN on rank 1 not found on rank " << comm.rank());

    // A rank with a different model: every rank learns which parameter differs.
    Linear odd;
    if (comm.rank() == 1) odd.params[1] = {std::vector<float>(5), std::vector<float>(5)};
    try {
      ddp::GradientAverager bad(comm, odd);
      MP_EXPECT(false, "no error for different models");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
      MP_EXPECT(std::string(e.what()).find(
                    "parameter 1 has 4 elements on rank 0 but 5 on rank 1") != std::string::npos,
                e.what());
    }
  });
}

TEST_CASE("training: compressed gradients stay within float16 and bfloat16 rounding") {
  // Linear's small gradients share a bucket; the extra large one is averaged in place.
  for (auto c : {ddp::Compression::float16, ddp::Compression::bfloat16}) {
    for (auto transport : {ddp::HostTransport::shm, ddp::HostTransport::tcp}) {
      mp::run(3, transport, [c](mp::Comm& comm) {
        Linear m;
        m.params.push_back({std::vector<float>(70000), std::vector<float>(70000)});
        ddp::GradientAverager avg(comm, m, {.compression = c});
        const auto value = [](int rank, std::size_t k) {
          return 0.5f + 0.499f * std::sin(static_cast<float>(k) * 1.7f + static_cast<float>(rank));
        };
        const std::size_t params = m.params.size();
        for (std::size_t p = 0; p < params; ++p)
          for (std::size_t k = 0; k < m.params[p].grad.size(); ++k)
            m.params[p].grad[k] = value(comm.rank(), k + p * 100);
        avg.average();
        // Each value is rounded once going out and the average once coming back.
        const double ulp =
            c == ddp::Compression::float16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
        for (std::size_t p = 0; p < params; ++p) {
          double worst = 0;
          for (std::size_t k = 0; k < m.params[p].grad.size(); ++k) {
            double exact = 0;
            for (int r = 0; r < comm.size(); ++r) exact += value(r, k + p * 100);
            exact /= comm.size();
            const double err = std::abs(m.params[p].grad[k] - exact) / exact;
            MP_EXPECT(err <= 2 * ulp, "relative error " << err << " at " << p << "[" << k << "]");
            worst = std::max(worst, err);
          }
          MP_EXPECT(worst > 0, "parameter " << p << " was not compressed (no rounding at all)");
        }
      });
    }
  }
}

TEST_CASE("training: buffers reallocated between steps are found again, resizing is refused") {
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    Linear m;
    ddp::GradientAverager avg(comm, m);
    for (int step = 0; step < 3; ++step) {
      m.params[1].grad =
          std::vector<float>(4, static_cast<float>(comm.rank() + step));  // new buffer
      avg.average();
      for (float g : m.params[1].grad)
        MP_EXPECT(g == 0.5f + static_cast<float>(step), "step " << step << ": " << g);
    }
    m.params[1].grad.resize(5);
    try {
      avg.average();
      MP_EXPECT(false, "a resized gradient was accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(std::string(e.what()).find("parameter 1 now has 4 values and 5 gradients") !=
                    std::string::npos,
                e.what());
    }
  });
}

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

namespace {
/// What was written to a temporary file through `fd`.
std::string written(int fd) {
  std::string out(4096, '\0');
  const ssize_t n = ::pread(fd, out.data(), out.size(), 0);
  out.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  return out;
}
}  // namespace

TEST_CASE("training: Logger prints whole lines on rank 0 or on every rank with its prefix") {
  char path[] = "/tmp/ddp-log-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::unlink(path);
  ddp::Logger(1, {.fd = fd}).print("rank %d says %s", 1, "nothing");
  ddp::Logger(0, {.fd = fd}).print("epoch %d: %s", 3, "loss 0.25");
  ddp::Logger(2, {.every_rank = true, .fd = fd}).print("%s", "mine");
  ddp::Logger(0, {.fd = fd}).print("%s", std::string(300, 'x').c_str());  // past the small buffer
  CHECK(written(fd) == "epoch 3: loss 0.25\n[r2] mine\n" + std::string(300, 'x') + "\n");
  CHECK(!ddp::Logger(0, {.fd = fd}).terminal());
  CHECK(!ddp::Logger(1).enabled());
  ::close(fd);
}

TEST_CASE("training: Progress writes a line per quarter in a log, redraws on a terminal") {
  char path[] = "/tmp/ddp-log-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::unlink(path);
  const ddp::Logger log(0, {.fd = fd});
  {
    ddp::Progress bar(log, "epoch 1/2", 1000, 4);
    for (std::size_t done = 10; done <= 1000; done += 10) bar.update(done, {{"loss", 0.5}});
    bar.finish();
  }
  const std::string out = written(fd);
  CAPTURE(out);
  CHECK(std::count(out.begin(), out.end(), '\n') == 4);
  CHECK(out.find('\r') == std::string::npos);
  for (const char* pct : {" 25%", " 50%", " 75%", "100%"})
    CHECK(out.find(pct) != std::string::npos);
  CHECK(out.rfind("epoch 1/2 [#####               ]  25%  ", 0) == 0);
  CHECK(out.find("samples/s  loss 0.5\n") != std::string::npos);
  // Stopped early: the final line says where.
  REQUIRE(::ftruncate(fd, 0) == 0);
  ::lseek(fd, 0, SEEK_SET);
  { ddp::Progress(log, "short", 1000).update(100); }
  CHECK(written(fd).find("short [##                  ]  10%") == 0);
  ::close(fd);
  // A terminal: one line redrawn with carriage returns, ended by finish().
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY);
  REQUIRE(master >= 0);
  REQUIRE(::grantpt(master) == 0);
  REQUIRE(::unlockpt(master) == 0);
  const int tty = ::open(::ptsname(master), O_RDWR | O_NOCTTY);
  REQUIRE(tty >= 0);
  termios raw{};
  ::tcgetattr(tty, &raw);
  ::cfmakeraw(&raw);
  ::tcsetattr(tty, TCSANOW, &raw);
  const ddp::Logger term(0, {.fd = tty});
  CHECK(term.terminal());
  {
    ddp::Progress bar(term, "tty", 100);
    bar.update(100);
    bar.finish();
  }
  std::string drawn;  // what the terminal shows, read until the line ends (writes may arrive apart)
  for (int tries = 0; tries < 200 && drawn.find('\n') == std::string::npos; ++tries) {
    pollfd pfd{master, POLLIN, 0};
    if (::poll(&pfd, 1, 10) != 1) continue;
    char buf[512];
    const ssize_t n = ::read(master, buf, sizeof buf);
    if (n > 0) drawn.append(buf, static_cast<std::size_t>(n));
  }
  CAPTURE(drawn);
  CHECK(drawn.rfind("\rtty [####################] 100%", 0) == 0);
  CHECK(drawn.back() == '\n');
  ::close(tty);
  ::close(master);
}

namespace {
/// A model of three parameters: one large enough to be averaged in place (a bucket of its own),
/// two packed into a bucket.
struct JoinModel {
  std::vector<Param> params;
  JoinModel() {
    for (std::size_t n : {std::size_t{70000}, std::size_t{10}, std::size_t{1000}})
      params.push_back({std::vector<float>(n, 0.5f), std::vector<float>(n)});
  }
  std::vector<Param>& parameters() { return params; }
};
/// Rank r's gradient element k at step s: quarters, so that sums are exact in any order (the
/// order itself is tested elsewhere) and in bfloat16.
float join_grad(int r, int s, std::size_t k) {
  return 0.25f * static_cast<float>((k * 7 + static_cast<std::size_t>(s + r)) % 13) *
         (r == 2 ? -1.0f : 1.0f);
}
/// Steps per rank: up to 3x apart.
int join_steps(int r) { return std::array<int, 4>{6, 18, 12, 9}[static_cast<std::size_t>(r)]; }

/// A user's own per-step collective, shadowed by finished ranks: the samples of each step.
struct SampleCounter : ddp::Joinable {
  mp::Comm* comm;
  double total = 0;
  explicit SampleCounter(mp::Comm& c) : comm(&c) {}
  void add(double samples) {
    double v = samples;
    comm->all_reduce_host(std::span<double>(&v, 1), ddp::ReduceOp::sum);
    total += v;
  }
  void join_step(int) override { add(0); }
};
}  // namespace

TEST_CASE("training: Join: uneven inputs finish, averaged over the ranks that trained each step") {
  for (ddp::Compression compression : {ddp::Compression::none, ddp::Compression::bfloat16}) {
    CAPTURE(static_cast<int>(compression));
    mp::each_world(
        [&](mp::Comm& comm) {
          const int me = comm.rank(), p = comm.size();
          JoinModel model;
          ddp::GradientAverager avg(comm, model, {.compression = compression});
          SampleCounter samples(comm);
          ddp::Join join(comm, {&avg, &samples});
          for (int s = 0; s < join_steps(me); ++s) {
            const int active = join.step();
            int want_active = 0;
            for (int j = 0; j < p; ++j) want_active += join_steps(j) > s;
            MP_EXPECT(active == want_active, "step " << s << ": " << active << " active");
            for (auto& prm : model.params)
              for (std::size_t k = 0; k < prm.grad.size(); ++k) prm.grad[k] = join_grad(me, s, k);
            avg.average();
            samples.add(32);
            for (auto& prm : model.params)
              for (std::size_t k = 0; k < prm.value.size(); ++k) prm.value[k] -= 0.5f * prm.grad[k];
            for (std::size_t i = 0; i < model.params.size(); ++i) {
              const auto& g = model.params[i].grad;
              for (std::size_t k = 0; k < g.size(); ++k) {
                float sum = 0;
                bool first = true;
                for (int j = 0; j < p; ++j) {  // rank order, finished ranks add nothing
                  if (join_steps(j) <= s) continue;
                  sum = first ? join_grad(j, s, k) : sum + join_grad(j, s, k);
                  first = false;
                }
                const float want = sum / static_cast<float>(active);
                if (compression == ddp::Compression::none) {
                  MP_EXPECT(std::memcmp(&g[k], &want, sizeof want) == 0,
                            "step " << s << " parameter " << i << "[" << k << "]: " << g[k]
                                    << " != " << want);
                } else {
                  MP_EXPECT(std::abs(g[k] - want) <= 0.02f * std::max(1.0f, std::abs(want)),
                            "step " << s << " parameter " << i << "[" << k << "]: " << g[k]
                                    << " vs " << want);
                }
              }
            }
          }
          join.finish();
          int longest = 0;
          double all_samples = 0;
          for (int j = 0; j < p; ++j) {
            longest = std::max(longest, join_steps(j));
            all_samples += 32.0 * join_steps(j);
          }
          MP_EXPECT(join.steps() == static_cast<std::size_t>(join_steps(me)), join.steps());
          MP_EXPECT(join.shadowed() == static_cast<std::size_t>(longest - join_steps(me)),
                    join.shadowed());
          MP_EXPECT(samples.total == all_samples, samples.total << " != " << all_samples);
          // Every rank now holds the parameters of the rank that trained longest (rank 1).
          MP_EXPECT(join.last() == (p == 1 ? 0 : 1), join.last());
          std::string mine;
          for (const auto& prm : model.params)
            mine.append(reinterpret_cast<const char*>(prm.value.data()),
                        prm.value.size() * sizeof(float));
          for (const auto& other : comm.all_gather_object(mine))
            MP_EXPECT(other == mine, "ranks ended with different parameters");
          // Out of the Join, the averager averages over every rank again.
          for (auto& prm : model.params)
            std::fill(prm.grad.begin(), prm.grad.end(), static_cast<float>(me));
          avg.average();
          MP_EXPECT(model.params[0].grad[5] ==
                        static_cast<float>(p * (p - 1) / 2) / static_cast<float>(p),
                    model.params[0].grad[5]);
        },
        {1, 2, 3, 4});
  }
}

TEST_CASE("training: Join: a step without join.step() is refused, the destructor finishes") {
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    JoinModel model;
    ddp::GradientAverager avg(comm, model);
    {
      ddp::Join join(comm, {&avg});
      try {
        avg.average();
        MP_EXPECT(false, "a step without join.step() was taken");
      } catch (const ddp::Error& e) {
        MP_EXPECT(e.code() == ddp::Errc::invalid_argument &&
                      std::string(e.what()).find("call join.step()") != std::string::npos,
                  e.what());
      }
      for (int s = 0; s < (comm.rank() == 0 ? 1 : 3); ++s) {
        (void)join.step();
        avg.average();
      }
    }  // ~Join finishes
    avg.average();
    try {
      ddp::Join join(comm, {nullptr});
      MP_EXPECT(false, "a null Joinable was taken");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
    }
  });
}

namespace {
/// A run of SGD with momentum over a shuffled, sharded dataset: `stop_after` steps then a
/// checkpoint at `path` (or to the end, -1), resuming from `path` when it exists. Returns the
/// final parameters' bytes (or "" when it stopped).
std::string train_with_checkpoints(mp::Comm& comm, const std::string& path, int stop_after) {
  constexpr std::size_t samples = 203, per_step = 5;
  constexpr int epochs = 3;
  std::vector<Param> model{{std::vector<float>(6, 0.1f), std::vector<float>(6)},
                           {std::vector<float>(1, 0.0f), std::vector<float>(1)}};
  std::vector<float> momentum(7, 0.0f);
  ddp::GradientAverager avg(comm, model);
  ddp::DistributedSampler sampler(samples, comm.size(), comm.rank(), {.shuffle = true, .seed = 11});
  int epoch = 0, step = 0;
  bool resumed = false;
  if (auto ck = ddp::load_checkpoint(comm, path)) {
    ck->get_values("w", std::span(model[0].value));
    ck->get_values("b", std::span(model[1].value));
    ck->get_values("momentum", std::span(momentum));
    step = ck->get_object<int>("step");
    const auto state = ck->get_object<ddp::SamplerState>("sampler");
    epoch = static_cast<int>(state.epoch);
    sampler.restore(state);
    resumed = true;
  }
  for (; epoch < epochs; ++epoch) {
    if (!resumed) sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    resumed = false;
    const auto mine = sampler.indices();
    for (std::size_t first = 0; first < mine.size(); first += per_step) {
      const std::size_t n = std::min(per_step, mine.size() - first);
      for (auto& p : model) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
      for (std::size_t k = first; k < first + n; ++k) {  // squared error of a linear model
        const auto s = static_cast<float>(mine[k]);
        float pred = model[1].value[0];
        for (std::size_t j = 0; j < 6; ++j)
          pred += model[0].value[j] * std::sin(s * static_cast<float>(j + 1));
        const float err = pred - std::cos(s);
        for (std::size_t j = 0; j < 6; ++j)
          model[0].grad[j] += err * std::sin(s * static_cast<float>(j + 1));
        model[1].grad[0] += err;
      }
      avg.average();
      for (std::size_t j = 0; j < 7; ++j) {
        float& g = j < 6 ? model[0].grad[j] : model[1].grad[0];
        float& v = j < 6 ? model[0].value[j] : model[1].value[0];
        momentum[j] = 0.9f * momentum[j] + g;
        v -= 0.01f * momentum[j];
      }
      if (++step == stop_after) {
        ddp::Checkpoint ck;
        ck.put_values("w", model[0].value);
        ck.put_values("b", model[1].value);
        ck.put_values("momentum", momentum);
        ck.put_object("step", step);
        ck.put_object("sampler", sampler.state(first + n));
        ddp::save_checkpoint(comm, ck, path);
        return "";
      }
    }
  }
  std::string out;
  for (const auto& p : model)
    out.append(reinterpret_cast<const char*>(p.value.data()), p.value.size() * sizeof(float));
  return out;
}
}  // namespace

TEST_CASE(
    "training: a run resumed from a checkpoint mid-epoch ends bitwise as an uninterrupted one") {
  for (int world : {1, 2, 3}) {
    for (int stop_after : {7, 21, 40}) {  // in the first, second or third epoch by world
      CAPTURE(world);
      CAPTURE(stop_after);
      mp::TempDir dir;
      const std::string ckpt = dir.file("run.ckpt");
      mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {
        const std::string whole = train_with_checkpoints(comm, dir.file("none.ckpt"), -1);
        if (comm.rank() == 0) mp::TempDir::write(dir.file("whole"), whole);
      });
      mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {
        MP_EXPECT(train_with_checkpoints(comm, ckpt, stop_after).empty(), "did not stop");
      });
      mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {  // new processes resume
        const std::string resumed = train_with_checkpoints(comm, ckpt, -1);
        for (const auto& other : comm.all_gather_object(resumed))
          MP_EXPECT(other == resumed, "ranks ended with different parameters");
        if (comm.rank() == 0) mp::TempDir::write(dir.file("resumed"), resumed);
      });
      const std::string whole = mp::TempDir::read(dir.file("whole"));
      CHECK(whole.size() == 7 * sizeof(float));
      CHECK(mp::TempDir::read(dir.file("resumed")) == whole);
    }
  }
}

TEST_CASE("training: checkpoints are written atomically and refused when foreign or damaged") {
  mp::TempDir dir;
  const std::string path = dir.file("a.ckpt");
  ddp::Checkpoint ck;
  const std::vector<double> values{1.5, -2.25, 1e300};
  ck.put_values("values", values);
  ck.put_object("name", std::string("run 7"));
  ck.put_object("sampler", ddp::SamplerState{3, 17, 11, 203, 2});
  ck.put("empty", {});
  ck.save(path);
  auto back = ddp::Checkpoint::load(path);
  REQUIRE(back.has_value());
  CHECK(back->names() == std::vector<std::string>{"values", "name", "sampler", "empty"});
  std::vector<double> got(3);
  back->get_values("values", std::span(got));
  CHECK(got == values);
  CHECK(back->get_object<std::string>("name") == "run 7");
  CHECK(back->get_object<ddp::SamplerState>("sampler").offset == 17u);
  CHECK(back->get("empty").empty());
  CHECK(!ddp::Checkpoint::load(dir.file("absent.ckpt")).has_value());
  // Asking for what is not there, or in another shape.
  std::vector<double> two(2);
  CHECK_THROWS_WITH_AS(back->get_values("values", std::span(two)),
                       doctest::Contains("holds 24 bytes, but 2 values of 8 bytes"), ddp::Error);
  CHECK_THROWS_WITH_AS(
      (void)back->get("nope"),
      doctest::Contains("no section \"nope\" (it has values, name, sampler, empty)"), ddp::Error);
  CHECK_THROWS_WITH_AS((void)back->get_object<int>("name"),
                       doctest::Contains("does not hold the type asked for"), ddp::Error);
  // Damaged files: every truncation, a flipped byte anywhere, something else entirely.
  const std::string good = mp::TempDir::read(path);
  const auto refused = [&](const std::string& bytes, const std::string& why) {
    mp::TempDir::write(dir.file("bad.ckpt"), bytes);
    try {
      (void)ddp::Checkpoint::load(dir.file("bad.ckpt"));
      FAIL("a damaged checkpoint was loaded");
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::protocol);
      CHECK(std::string(e.what()).find(why) != std::string::npos);
      CHECK(std::string(e.what()).find("bad.ckpt") != std::string::npos);
    }
  };
  for (std::size_t n = 0; n < good.size(); ++n) refused(good.substr(0, n), "");
  for (std::size_t i = 0; i < good.size(); ++i) {
    std::string flipped = good;
    flipped[i] = static_cast<char>(flipped[i] ^ 0x20);
    refused(flipped, i < 8 ? "not a ddp checkpoint" : "");
  }
  refused("hello, this is a text file, long enough to look like something", "not a ddp checkpoint");
  refused(good + "x", "checksum does not match");
  // A save that cannot complete leaves the old file as it was and no temporary file behind.
  ::mkdir(dir.file("taken").c_str(), 0755);
  CHECK_THROWS_WITH_AS(ck.save(dir.file("taken")), doctest::Contains("is a directory"), ddp::Error);
  CHECK_THROWS_WITH_AS(ck.save(dir.file("no/such/dir/a.ckpt")), doctest::Contains("cannot create"),
                       ddp::Error);
  ck.put_object("name", std::string("run 8"));
  ck.save(path);
  CHECK(ddp::Checkpoint::load(path)->get_object<std::string>("name") == "run 8");
  int leftovers = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path))
    leftovers += e.path().string().find(".tmp.") != std::string::npos;
  CHECK(leftovers == 0);
}

TEST_CASE("training: load_checkpoint gives every rank the same checkpoint, or the same error") {
  mp::TempDir dir;
  mp::TempDir::write(dir.file("junk.ckpt"), "not a checkpoint at all, just some words");
  mp::run(3, ddp::HostTransport::tcp, [&](mp::Comm& comm) {
    MP_EXPECT(!ddp::load_checkpoint(comm, dir.file("none.ckpt")).has_value(), "a missing file");
    ddp::Checkpoint ck;
    ck.put_object("rank", comm.rank());  // only rank 0's is saved
    ddp::save_checkpoint(comm, ck, dir.file("c.ckpt"));
    const auto back = ddp::load_checkpoint(comm, dir.file("c.ckpt"));
    MP_EXPECT(back && back->get_object<int>("rank") == 0, "rank 0's checkpoint everywhere");
    try {
      (void)ddp::load_checkpoint(comm, dir.file("junk.ckpt"));
      MP_EXPECT(false, "junk was loaded");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::protocol &&
                    std::string(e.what()).find("rank 0 could not load") != std::string::npos &&
                    std::string(e.what()).find("not a ddp checkpoint") != std::string::npos,
                e.what());
    }
    try {
      ddp::save_checkpoint(comm, ck, dir.file("no/such/dir/c.ckpt"));
      MP_EXPECT(false, "a checkpoint was saved into a missing directory");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::system &&
                    std::string(e.what()).find("rank 0 could not save") != std::string::npos,
                e.what());
    }
  });
}
