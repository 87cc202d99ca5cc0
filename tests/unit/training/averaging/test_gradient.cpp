// GradientAverager across real processes: data-parallel SGD equals one process with the whole
// batch, buckets and no_sync, compressed gradients, gradient buffers reallocated between steps.
#include <ddp/training/averaging/gradient.hpp>

#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/detail/json.hpp>
#include <ddp/training/zero/sharded.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "multiprocess.hpp"

// Named, so that the executable can be built as one unity translation unit.
namespace gradient_tests {

static_assert(ddp::ProcessGroup<ddp::Communicator<ddp::backend::Host>>,
              "exact_mean and sync_batch_stats take any communicator");

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
Linear train(mp::Comm& comm, ddp::BucketOptions options = {}) {
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

TEST_CASE(
    "training: grad_norm and clip_grad_norm over the averaged gradients, equal on every rank") {
  for (int world : {1, 2, 3, 4}) {
    for (auto transport : {ddp::HostTransport::shm, ddp::HostTransport::tcp}) {
      if (transport == ddp::HostTransport::tcp && world != 3) continue;
      CAPTURE(world);
      mp::run(world, transport, [](mp::Comm& comm) {
        Linear m;
        ddp::GradientAverager avg(comm, m, {.bucket_bytes = 64, .first_bucket_bytes = 16});
        const auto grad = [](int rank, std::size_t p, std::size_t k) {
          return 0.25f * std::sin(static_cast<float>(rank * 31 + static_cast<int>(p * 7 + k)));
        };
        for (std::size_t p = 0; p < m.params.size(); ++p)
          for (std::size_t k = 0; k < m.params[p].grad.size(); ++k)
            m.params[p].grad[k] = grad(comm.rank(), p, k);
        avg.average();
        // By hand: the mean over the ranks of each element, squared and summed.
        double want = 0;
        for (std::size_t p = 0; p < m.params.size(); ++p)
          for (std::size_t k = 0; k < m.params[p].grad.size(); ++k) {
            double mean = 0;
            for (int r = 0; r < comm.size(); ++r) mean += grad(r, p, k);
            mean /= comm.size();
            want += mean * mean;
          }
        want = std::sqrt(want);
        const double norm = avg.grad_norm();
        MP_EXPECT(std::abs(norm - want) <= 1e-6 * want, "grad_norm " << norm << " vs " << want);
        const auto all = comm.all_gather_object(norm);
        for (double other : all) MP_EXPECT(other == norm, "grad_norm differs between ranks");

        // Under the limit: nothing changes; over it: scaled to the limit.
        const auto before = m.params;
        MP_EXPECT(avg.clip_grad_norm(2 * norm) == norm, "clip_grad_norm returns the norm");
        for (std::size_t p = 0; p < m.params.size(); ++p)
          MP_EXPECT(m.params[p].grad == before[p].grad, "a gradient under the limit changed");
        MP_EXPECT(avg.clip_grad_norm(norm / 2) == norm, "clip_grad_norm returns the norm before");
        const double coef = (norm / 2) / (norm + 1e-6);
        for (std::size_t p = 0; p < m.params.size(); ++p)
          for (std::size_t k = 0; k < m.params[p].grad.size(); ++k)
            MP_EXPECT(m.params[p].grad[k] ==
                          static_cast<float>(before[p].grad[k] * static_cast<float>(coef)),
                      "parameter " << p << "[" << k << "] not scaled by the clip");
        const double clipped = avg.grad_norm();
        MP_EXPECT(std::abs(clipped - norm / 2) <= 1e-5 * norm, "clipped norm " << clipped);

        // A non-finite average: named, on every rank, gradients untouched; or returned.
        if (comm.rank() == comm.size() - 1) m.params[1].grad[2] = INFINITY;
        avg.average();
        const auto inf = m.params;
        try {
          (void)avg.clip_grad_norm(1.0);
          MP_EXPECT(false, "no error for an inf gradient on rank " << comm.rank());
        } catch (const ddp::Error& e) {
          MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
          MP_EXPECT(std::string(e.what()).find("parameter 1's average holds an inf or a NaN") !=
                        std::string::npos,
                    e.what());
        }
        MP_EXPECT(std::isinf(avg.clip_grad_norm(1.0, false)), "error_if_nonfinite = false");
        for (std::size_t p = 0; p < m.params.size(); ++p)
          MP_EXPECT(m.params[p].grad == inf[p].grad, "a non-finite step's gradients changed");
        try {
          (void)avg.clip_grad_norm(-1.0);
          MP_EXPECT(false, "a negative max_norm accepted");
        } catch (const ddp::Error& e) {
          MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
        }
      });
    }
  }
}

// Two double parameters (3 and 5 elements): gradients up to 1e200, whose squares overflow.
struct ParamD {
  std::vector<double> value, grad;
};
struct Huge {
  std::vector<ParamD> params{{std::vector<double>(3), std::vector<double>(3)},
                             {std::vector<double>(5), std::vector<double>(5)}};
  std::vector<ParamD>& parameters() { return params; }
};

TEST_CASE(
    "training: grad_norm of finite double gradients whose squares overflow or underflow is their "
    "norm, not inf or 0 (GradientAverager and ShardedAverager)") {
  for (const int world : {1, 3}) {
    CAPTURE(world);
    mp::run(world, ddp::HostTransport::shm, [](mp::Comm& comm) {
      // Rank r's gradient of parameter p, element k: big * (r + 1) * (k + 1) * (p + 1).
      const auto fill = [&](Huge& m, double big) {
        for (std::size_t p = 0; p < m.params.size(); ++p)
          for (std::size_t k = 0; k < m.params[p].grad.size(); ++k)
            m.params[p].grad[k] =
                big * static_cast<double>(comm.rank() + 1) * static_cast<double>((k + 1) * (p + 1));
      };
      // The norm of the averages, by hand and scaled: big * sqrt(sum of (mean / big)^2).
      const auto want = [&](const Huge& m, double big) {
        const double mean_rank = (comm.size() + 1) / 2.0;
        double ssq = 0;
        for (std::size_t p = 0; p < m.params.size(); ++p)
          for (std::size_t k = 0; k < m.params[p].grad.size(); ++k) {
            const double x = mean_rank * static_cast<double>((k + 1) * (p + 1));
            ssq += x * x;
          }
        return big * std::sqrt(ssq);
      };
      {
        Huge m;
        ddp::GradientAverager avg(comm, m);
        fill(m, 1e200);
        avg.average();
        const double norm = avg.grad_norm();
        MP_EXPECT(std::abs(norm - want(m, 1e200)) <= 1e-12 * want(m, 1e200),
                  "grad_norm " << norm << " vs " << want(m, 1e200));
        MP_EXPECT(avg.clip_grad_norm(1.0) == norm, "clip_grad_norm refused or changed the norm");
        MP_EXPECT(std::abs(avg.grad_norm() - 1.0) <= 1e-9, "clipped to " << avg.grad_norm());
        // Ordinary gradients: the plain sum of squares, as before.
        fill(m, 1e-3);
        avg.average();
        MP_EXPECT(std::abs(avg.grad_norm() - want(m, 1e-3)) <= 1e-12 * want(m, 1e-3),
                  "grad_norm " << avg.grad_norm());
        // Gradients whose squares underflow (1e-200), or are subnormal themselves: not 0.
        for (const double tiny : {1e-200, 1e-310}) {
          fill(m, tiny);
          avg.average();
          MP_EXPECT(std::abs(avg.grad_norm() - want(m, tiny)) <= 1e-9 * want(m, tiny),
                    "grad_norm " << avg.grad_norm() << " vs " << want(m, tiny));
        }
        fill(m, 0.0);  // zeros stay 0
        avg.average();
        MP_EXPECT(avg.grad_norm() == 0.0, avg.grad_norm());
      }
      {
        // All finite, the norm itself beyond the largest double (1008 elements of 1e307: the
        // norm is 3.2e308): said so, not "inf or NaN".
        Huge m;
        m.params.push_back({std::vector<double>(1000), std::vector<double>(1000)});
        ddp::GradientAverager avg(comm, m);
        for (auto& p : m.params) std::fill(p.grad.begin(), p.grad.end(), 1e307);
        avg.average();
        MP_EXPECT(std::isinf(avg.grad_norm()), "a norm beyond DBL_MAX is " << avg.grad_norm());
        try {
          (void)avg.clip_grad_norm(1.0);
          MP_EXPECT(false, "a norm beyond the largest double was clipped");
        } catch (const ddp::Error& e) {
          const std::string w = e.what();
          MP_EXPECT(w.find("the averaged gradients are all finite, but their norm is beyond the "
                           "largest double") != std::string::npos,
                    w);
          MP_EXPECT(w.find("inf or a NaN") == std::string::npos, w);
        }
      }
      {
        Huge m;
        ddp::ShardedAverager zero(comm, m, {.bucket_bytes = 16});
        fill(m, 1e200);
        zero.average();
        const double norm = zero.grad_norm();
        MP_EXPECT(std::abs(norm - want(m, 1e200)) <= 1e-12 * want(m, 1e200),
                  "ShardedAverager::grad_norm " << norm << " vs " << want(m, 1e200));
        for (const double other : comm.all_gather_object(norm))
          MP_EXPECT(other == norm, "grad_norm differs between ranks");
        // An inf stays inf (and NaN NaN), whoever holds it.
        if (comm.rank() == comm.size() - 1) m.params[1].grad[4] = INFINITY;
        zero.average();
        MP_EXPECT(std::isinf(zero.grad_norm()), "an inf gradient's norm");
      }
    });
  }
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

}  // namespace gradient_tests

namespace gradient_tests {
namespace {

// One span of a rank's timeline file.
struct Span {
  std::string name, cat;
  double ts = 0, dur = 0;
  int pid = -1, tid = -1;
  std::int64_t bucket = -1;
};

// The spans of one timeline file, checked to be a complete Chrome trace-event document.
std::vector<Span> read_timeline(const std::string& path, int& rank) {
  const auto doc = ddp::detail::parse_json(mp::TempDir::read(path));
  const auto* events = doc.find("traceEvents");
  REQUIRE(events != nullptr);
  REQUIRE(events->type == ddp::detail::Json::Type::array);
  rank = static_cast<int>(doc.find("otherData")->integer("ddp_rank", -1));
  std::vector<Span> spans;
  bool named = false;
  for (const auto& e : events->items) {
    const std::string ph = e.get("ph");
    CHECK(e.integer("pid", -1) == rank);  // one process per rank
    if (ph == "M") {
      if (e.get("name") == "process_name")
        named = e.find("args")->get("name") == "rank " + std::to_string(rank);
      continue;
    }
    REQUIRE(ph == "X");
    Span s{e.get("name"),
           e.get("cat"),
           std::stod(e.get("ts")),
           std::stod(e.get("dur")),
           static_cast<int>(e.integer("pid")),
           static_cast<int>(e.integer("tid"))};
    if (const auto* args = e.find("args")) s.bucket = args->integer("bucket", -1);
    CHECK(s.dur >= 0);
    spans.push_back(s);
  }
  CHECK(named);
  return spans;
}

}  // namespace

TEST_CASE("timeline: every rank's steps, buckets and collectives, as Chrome trace events") {
  mp::TempDir dir;
  const std::string where = dir.file("timeline");
  ::setenv("DDP_TIMELINE", where.c_str(), 1);
  for (int world : {1, 3}) {
    CAPTURE(world);
    mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {
      Linear m;
      ddp::GradientAverager avg(comm, m, {.bucket_bytes = 64, .first_bucket_bytes = 16});
      for (int step = 0; step < 3; ++step) {
        {
          ddp::TimelineSpan forward("forward and backward");
          backward(m, step * batch, batch / comm.size());
        }
        avg.mark_ready(1);
        avg.mark_ready(0);
        avg.synchronize();
        sgd(m, 0.1f);
      }
      ddp::Checkpoint ck;
      ck.put_object("step", std::int64_t{3});
      ck.save(dir.file("ck-" + std::to_string(comm.rank())));
    });
    std::vector<std::string> files;
    for (const auto& f : std::filesystem::directory_iterator(where)) files.push_back(f.path());
    REQUIRE(files.size() == static_cast<std::size_t>(world));
    std::set<int> ranks;
    for (const auto& f : files) {
      int rank = -1;
      const auto spans = read_timeline(f, rank);
      ranks.insert(rank);
      const auto count = [&](const std::string& name) {
        return std::count_if(spans.begin(), spans.end(),
                             [&](const Span& s) { return s.name == name; });
      };
      CHECK(count("step 0") == 1);
      CHECK(count("step 2") == 1);
      CHECK(count("synchronize") == 3);
      CHECK(count("forward and backward") == 3);
      CHECK(count("checkpoint save") == 1);
      CHECK(count("bucket 0") == 3);  // one per step
      // Every bucket's all_reduce lies inside the step that issued it, on the group's track.
      int bucket_ops = 0;
      for (const Span& c : spans) {
        if (c.cat != "collective" || c.bucket < 0) continue;
        ++bucket_ops;
        CHECK(c.tid >= 2);
        CHECK(c.name.starts_with("all_reduce (bucket "));
        const bool inside = std::any_of(spans.begin(), spans.end(), [&](const Span& s) {
          return s.cat == "step" && s.name.starts_with("step ") && s.ts <= c.ts + 0.001 &&
                 c.ts + c.dur <= s.ts + s.dur + 0.001;
        });
        CHECK_MESSAGE(inside, c.name << " at " << c.ts << " is in no step");
      }
      CHECK(bucket_ops >= 3 * 2);  // at least two buckets a step
    }
    CHECK(ranks.size() == static_cast<std::size_t>(world));
    [[maybe_unused]] const int rc = std::system(("rm -rf " + where).c_str());
  }
  ::unsetenv("DDP_TIMELINE");
}

}  // namespace gradient_tests
