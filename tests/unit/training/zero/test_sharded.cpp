#include <ddp/training/averaging/gradient.hpp>
#include <ddp/training/zero/sharded.hpp>
#include <ddp/training/zero/sharded_checkpoint.hpp>

#include <doctest/doctest.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "multiprocess.hpp"

// Named, so that the executable can be built as one unity translation unit.
namespace sharded_tests {

namespace {

struct Param {
  std::vector<float> value, grad;
};

// Sizes chosen so that shards are uneven for 3 and 4 ranks: parameters in place (with leftovers
// of 1 to 3 elements), packed buckets whose length is not a multiple of the world size, and a
// parameter of a single element.
struct Net {
  std::vector<Param> params;
  Net() {
    for (std::size_t n : {37u, 1001u, 3u, 129u, 1u, 5002u, 64u}) {
      Param p{std::vector<float>(n), std::vector<float>(n)};
      for (std::size_t k = 0; k < n; ++k)
        p.value[k] = 0.5f * std::sin(0.3f * static_cast<float>(k + 7 * n));
      params.push_back(std::move(p));
    }
  }
  std::vector<Param>& parameters() { return params; }
};

// Small buckets and a low in-place threshold: every path of the layout in one small model.
constexpr ddp::BucketOptions sharded_options{
    .bucket_bytes = 512, .first_bucket_bytes = 128, .in_place_bytes = 1024};

// A loss whose gradient depends on the parameters: rank r at step s pulls each value toward a
// target of its own, with a curvature per element.
void backward(Net& m, int rank, int step) {
  for (std::size_t i = 0; i < m.params.size(); ++i) {
    auto& p = m.params[i];
    for (std::size_t k = 0; k < p.value.size(); ++k) {
      const float x = static_cast<float>(k) * 0.01f + static_cast<float>(i);
      const float target =
          std::cos(x + 0.7f * static_cast<float>(rank) + 0.3f * static_cast<float>(step));
      p.grad[k] = (1.0f + 0.5f * std::sin(x)) * (p.value[k] - target);
    }
  }
}

// An optimizer over flat (value, gradient, n) ranges, keyed by range: it works on the whole
// model or on a shard, and counts the state it holds.
struct Range {
  float* value;
  const float* grad;
  std::size_t n;
};

std::vector<Range> ranges(Net& m) {
  std::vector<Range> out;
  for (auto& p : m.params) out.push_back({p.value.data(), p.grad.data(), p.value.size()});
  return out;
}
template <class Shard>
std::vector<Range> ranges(Shard&& shard) {
  std::vector<Range> out;
  for (auto& s : shard) out.push_back({s.value.data, s.grad.data, s.value.size});
  return out;
}

struct Optimizer {
  explicit Optimizer(bool use_adam) : adam(use_adam) {}
  bool adam = false;
  std::vector<std::vector<float>> m, v;  // momentum / Adam's moments, one per range
  int t = 0;
  void step(const std::vector<Range>& rs) {
    if (m.empty()) {
      for (const Range& r : rs) {
        m.emplace_back(r.n, 0.0f);
        if (adam) v.emplace_back(r.n, 0.0f);
      }
    }
    ++t;
    for (std::size_t j = 0; j < rs.size(); ++j) {
      const Range& r = rs[j];
      for (std::size_t k = 0; k < r.n; ++k) {
        const float g = r.grad[k];
        if (!adam) {  // SGD with momentum 0.9, lr 0.05
          m[j][k] = 0.9f * m[j][k] + g;
          r.value[k] -= 0.05f * m[j][k];
          continue;
        }
        m[j][k] = 0.9f * m[j][k] + 0.1f * g;  // Adam: lr 0.01, betas (0.9, 0.999), eps 1e-8
        v[j][k] = 0.999f * v[j][k] + 0.001f * g * g;
        const float mh = m[j][k] / (1.0f - std::pow(0.9f, static_cast<float>(t)));
        const float vh = v[j][k] / (1.0f - std::pow(0.999f, static_cast<float>(t)));
        r.value[k] -= 0.01f * mh / (std::sqrt(vh) + 1e-8f);
      }
    }
  }
  [[nodiscard]] std::size_t state_bytes() const {
    std::size_t n = 0;
    for (const auto& x : m) n += x.size() * sizeof(float);
    for (const auto& x : v) n += x.size() * sizeof(float);
    return n;
  }
};

std::string bytes_of(const Net& m) {
  std::string s;
  for (const auto& p : m.params)
    s.append(reinterpret_cast<const char*>(p.value.data()), p.value.size() * sizeof(float));
  return s;
}

constexpr int steps = 20;

}  // namespace

TEST_CASE("sharded: 20 SGD-momentum and Adam steps equal the unsharded run, state 1/P") {
  for (bool adam : {false, true}) {
    for (int world : {1, 2, 3, 4}) {
      CAPTURE(adam);
      CAPTURE(world);
      mp::run(
          world, world == 3 ? ddp::HostTransport::tcp : ddp::HostTransport::shm,
          [&](mp::Comm& comm) {
            // The unsharded reference: GradientAverager and the optimizer on every parameter.
            Net full;
            Optimizer full_opt(adam);
            ddp::GradientAverager avg(comm, full);
            // Sharded: the optimizer sees this rank's shard only.
            Net net;
            Optimizer opt(adam);
            ddp::ShardedAverager zero(comm, net, sharded_options);
            for (int step = 0; step < steps; ++step) {
              backward(full, comm.rank(), step);
              avg.average();
              full_opt.step(ranges(full));

              backward(net, comm.rank(), step);
              // Marked in backward's order, so buckets start while "backward" goes on.
              for (std::size_t i = net.params.size(); i-- > 0;) zero.mark_ready(i);
              zero.synchronize();
              opt.step(ranges(zero.shard()));
              zero.gather();
            }
            double worst = 0;
            for (std::size_t i = 0; i < net.params.size(); ++i) {
              for (std::size_t k = 0; k < net.params[i].value.size(); ++k) {
                const double a = net.params[i].value[k], b = full.params[i].value[k];
                worst = std::max(worst, std::abs(a - b) / std::max(1e-3, std::abs(b)));
              }
            }
            MP_EXPECT(worst <= 1e-6, "largest relative difference " << worst);
            for (const auto& other : comm.all_gather_object(bytes_of(net)))
              MP_EXPECT(other == bytes_of(net), "ranks ended with different parameters");

            // The shard: disjoint ranges covering every element once, balanced to within a
            // few elements (one per bucket), and the optimizer's state in proportion.
            std::vector<std::uint64_t> sizes{zero.shard_size()};
            const auto all = comm.all_gather_object(sizes);
            std::uint64_t sum = 0, lo = ~0ull, hi = 0;
            for (const auto& s : all) {
              sum += s[0];
              lo = std::min(lo, s[0]);
              hi = std::max(hi, s[0]);
            }
            MP_EXPECT(sum == zero.total_size(), sum << " elements owned of " << zero.total_size());
            MP_EXPECT(hi - lo <= zero.buckets().size(), "shards of " << lo << " to " << hi);
            const double share = static_cast<double>(opt.state_bytes()) /
                                 static_cast<double>(full_opt.state_bytes());
            const double ideal = 1.0 / comm.size();
            MP_EXPECT(std::abs(share - ideal) <= 0.01, "optimizer state "
                                                           << opt.state_bytes() << " of "
                                                           << full_opt.state_bytes() << " bytes");
            std::vector<int> owned(zero.total_size(), 0);
            std::vector<std::size_t> start{0};
            for (const auto& p : net.params) start.push_back(start.back() + p.value.size());
            for (const auto& s : zero.shard())
              for (std::size_t k = 0; k < s.value.size; ++k) ++owned[start[s.param] + s.offset + k];
            std::vector<std::int32_t> count(owned.begin(), owned.end());
            comm.all_reduce(count);
            for (std::size_t k = 0; k < count.size(); ++k)
              MP_EXPECT(count[k] == 1, "element " << k << " is owned by " << count[k] << " ranks");
          });
    }
  }
}

TEST_CASE("sharded: step(), no_sync, unused parameters, grad_norm, non-finite, mismatches") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    Net net;
    ddp::ShardedAverager zero(comm, net, sharded_options);
    // Every rank's gradient of parameter i, element k: (rank + 1) * (k + 1) / 100.
    const auto fill = [&](Net& m, float scale) {
      for (auto& p : m.params)
        for (std::size_t k = 0; k < p.grad.size(); ++k)
          p.grad[k] = scale * static_cast<float>(comm.rank() + 1) * static_cast<float>(k + 1) / 100;
    };
    // no_sync: two micro-batches accumulate; the average is over both (mean of rank+1 is 2).
    {
      auto guard = zero.no_sync();
      fill(net, 1.0f);
      zero.average();  // ignored
      zero.step([](auto) { MP_EXPECT(false, "step inside no_sync"); });
    }
    std::vector<std::vector<float>> first;
    for (auto& p : net.params) first.push_back(p.grad);
    fill(net, 1.0f);
    for (std::size_t i = 0; i < net.params.size(); ++i)
      for (std::size_t k = 0; k < first[i].size(); ++k) net.params[i].grad[k] += first[i][k];
    // Parameter 2 is marked on rank 0 only: the others count as zero.
    if (comm.rank() == 0) zero.mark_ready(2);
    for (std::size_t i : {6u, 5u, 4u, 3u, 1u, 0u}) zero.mark_ready(i);
    zero.synchronize();
    double norm2 = 0;
    for (const auto& s : zero.shard()) {
      for (std::size_t k = 0; k < s.grad.size; ++k) {
        const double kk = static_cast<double>(s.offset + k + 1);
        const double want = s.param == 2 ? 2.0 * kk / 100 / 3 : 2 * 2.0 * kk / 100;
        MP_EXPECT(std::abs(s.grad.data[k] - want) <= 1e-5 * want,
                  "parameter " << s.param << "[" << s.offset + k << "]: " << s.grad.data[k]
                               << " vs " << want);
      }
    }
    for (std::size_t i = 0; i < net.params.size(); ++i) {
      for (std::size_t k = 0; k < net.params[i].grad.size(); ++k) {
        const double kk = static_cast<double>(k + 1);
        const double want = i == 2 ? 2.0 * kk / 100 / 3 : 4.0 * kk / 100;
        norm2 += want * want;
      }
    }
    const double norm = zero.grad_norm();
    MP_EXPECT(std::abs(norm - std::sqrt(norm2)) <= 1e-5 * std::sqrt(norm2),
              "grad_norm " << norm << " vs " << std::sqrt(norm2));
    MP_EXPECT(!zero.found_nonfinite(), "finite gradients reported as non-finite");
    // step(): the update sees the shard; every rank gets every update.
    fill(net, 1.0f);
    zero.step([](std::span<ddp::ShardSlice<float>> shard) {
      for (auto& s : shard)
        for (std::size_t k = 0; k < s.value.size; ++k)
          s.value.data[k] = static_cast<float>(s.param) + 1;
    });
    for (std::size_t i = 0; i < net.params.size(); ++i)
      for (float v : net.params[i].value)
        MP_EXPECT(v == static_cast<float>(i) + 1, "parameter " << i << " holds " << v);
    // A NaN in one rank's gradient reaches its owner's shard: every rank learns of it.
    fill(net, 1.0f);
    if (comm.rank() == 1) net.params[5].grad[4000] = std::nanf("");
    zero.average();
    MP_EXPECT(zero.found_nonfinite(), "a NaN on rank 1 not found on rank " << comm.rank());
    // gather() while a step's reduction is under way is refused; a parameter resized too.
    zero.mark_ready(6);
    mp::expect_refused(comm, "gather mid-step", "call synchronize() first", [&] { zero.gather(); });
    zero.synchronize();
    net.params[0].grad.resize(36);
    mp::expect_refused(comm, "a resized gradient", "parameter 0 now has 37 values and 36 gradients",
                       [&] { zero.average(); });
    net.params[0].grad.resize(37);
    zero.average();

    // Different bucket options on different ranks: refused, naming the option.
    try {
      ddp::ShardedAverager bad(comm, net, {.bucket_bytes = comm.rank() == 1 ? 256u : 512u});
      MP_EXPECT(false, "no error for different options");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
      MP_EXPECT(std::string(e.what()).find("BucketOptions::bucket_bytes is 512 on rank 0 but 256 "
                                           "on rank 1") != std::string::npos,
                e.what());
    }
    // Different models on different ranks: every rank learns which parameter differs.
    Net odd;
    if (comm.rank() == 2) odd.params[3] = {std::vector<float>(5), std::vector<float>(5)};
    try {
      ddp::ShardedAverager bad(comm, odd);
      MP_EXPECT(false, "no error for different models");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
      MP_EXPECT(std::string(e.what()).find("ShardedAverager: parameter 3 has 129 elements on rank "
                                           "0 but 5 on rank 2") != std::string::npos,
                e.what());
    }
  });
}

namespace {
// Trains `steps` Adam steps with the state saved every 5 steps (parameters by rank 0, the
// optimizer's shard by each rank); stops after step `stop` (-1: never). Returns the parameters.
std::string train_resumable(mp::Comm& comm, const std::string& path, int stop) {
  Net net;
  Optimizer opt(true);
  ddp::ShardedAverager zero(comm, net, sharded_options);
  int first = 0;
  if (auto ck = zero.load(path)) {  // every rank's shard of the parameters, gathered
    first = ck->get_object<int>("step");
    opt.t = ck->get_object<int>("t");
    opt.m = ck->get_object<std::vector<std::vector<float>>>("m");
    opt.v = ck->get_object<std::vector<std::vector<float>>>("v");
  }
  for (int step = first; step < steps; ++step) {
    backward(net, comm.rank(), step);
    zero.step([&](auto shard) { opt.step(ranges(shard)); });
    if ((step + 1) % 5 == 0) {
      // The model may reallocate its buffers between steps: save() finds them where they are
      // now (ASan would see a read of the old ones).
      net.params[1].value = std::vector<float>(net.params[1].value);
      net.params[1].grad = std::vector<float>(net.params[1].grad);
      ddp::Checkpoint state;  // this rank's: the optimizer's state for its shard, and the step
      state.put_object("step", step + 1).put_object("t", opt.t).put_object("m", opt.m);
      state.put_object("v", opt.v);
      zero.save(state, path);
    }
    if (step == stop) return {};
  }
  return bytes_of(net);
}
}  // namespace

TEST_CASE("sharded: a run resumed from sharded checkpoints ends bitwise as an uninterrupted one") {
  for (int world : {2, 3}) {
    CAPTURE(world);
    mp::TempDir dir;
    mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {
      const std::string whole = train_resumable(comm, dir.file("none"), -1);
      if (comm.rank() == 0) mp::TempDir::write(dir.file("whole"), whole);
    });
    mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {
      MP_EXPECT(train_resumable(comm, dir.file("run"), 12).empty(), "did not stop");
    });
    mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {  // new processes resume at 10
      const std::string resumed = train_resumable(comm, dir.file("run"), -1);
      if (comm.rank() == 0) mp::TempDir::write(dir.file("resumed"), resumed);
    });
    CHECK(!mp::TempDir::read(dir.file("whole")).empty());
    CHECK(mp::TempDir::read(dir.file("resumed")) == mp::TempDir::read(dir.file("whole")));
  }
}

TEST_CASE("sharded: an interrupted save, files of different saves, a damaged file") {
  mp::TempDir dir;
  const std::string path = dir.file("s");
  const auto expect = [](mp::Comm& comm, ddp::Errc code, const std::string& needle, auto&& call) {
    try {
      call();
      MP_EXPECT(false, "accepted: " << needle);
    } catch (const ddp::Error& e) {
      const std::string m = e.what();
      MP_EXPECT(e.code() == code && m.find(needle) != std::string::npos, m);
      MP_EXPECT(m.find("rank " + std::to_string(comm.rank())) == 0, m);
    }
  };
  mp::run(2, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    MP_EXPECT(!ddp::load_sharded_checkpoint(comm, path).has_value(), "no files: a fresh start");
    ddp::Checkpoint ck;
    ck.put_object("rank", comm.rank());
    const auto id = ddp::save_sharded_checkpoint(comm, ck, path);
    const auto back = ddp::load_sharded_checkpoint(comm, path);
    MP_EXPECT(back && back->get_object<int>("rank") == comm.rank(), "each rank its own shard");
    // (A save that fails on one rank, at each of its steps: test_checkpoint_faults.cpp.)
    // A save cut short after rank 0's new generation was written (rank 1 died): the newest
    // generation that every rank has is loaded.
    const std::string mine = ddp::shard_path(path, comm.rank(), 2);
    const auto file_of = [](const std::string& stem, int g) {  // "<stem>.<g>.<id>"
      const std::string prefix =
          std::filesystem::path(stem).filename().string() + "." + std::to_string(g) + ".";
      for (const auto& e :
           std::filesystem::directory_iterator(std::filesystem::path(stem).parent_path()))
        if (e.path().filename().string().rfind(prefix, 0) == 0) return e.path().string();
      return stem + "." + std::to_string(g) + ".none";
    };
    const std::string first = file_of(mine, 1);
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(id));
    MP_EXPECT(first.substr(first.size() - 16) == hex, first << " is not named by its save id");
    comm.barrier();
    if (comm.rank() == 0)
      std::filesystem::copy_file(first, mine + ".7" + first.substr(first.rfind('.')));
    comm.barrier();
    const auto recovered = ddp::load_sharded_checkpoint(comm, path);
    MP_EXPECT(recovered && recovered->get_object<int>("rank") == comm.rank(), "generation 1");
    comm.barrier();
    if (comm.rank() == 0) std::filesystem::remove(file_of(mine, 7));
    // Two saves of generation 1 on rank 1 (another job's, under the same path): the one every
    // rank has is loaded.
    if (comm.rank() == 1)
      mp::TempDir::write(mine + ".1.00000000000000ff", "another job's file, never loaded here");
    comm.barrier();
    const auto either = ddp::load_sharded_checkpoint(comm, path);
    MP_EXPECT(either && ddp::shard_save_id(*either) == id, "the save every rank has");
    comm.barrier();
    if (comm.rank() == 1) std::filesystem::remove(mine + ".1.00000000000000ff");
    // A damaged file on rank 0.
    if (comm.rank() == 0) mp::TempDir::write(first, "garbage, not a shard");
    comm.barrier();
    expect(comm, ddp::Errc::protocol, "load_sharded_checkpoint: rank 0 failed",
           [&] { (void)ddp::load_sharded_checkpoint(comm, path); });
    // Another rank's file in this rank's place (a save makes generation 2 of both).
    (void)ddp::save_sharded_checkpoint(comm, ck, path);
    if (comm.rank() == 0)
      std::filesystem::copy_file(file_of(ddp::shard_path(path, 1, 2), 2), file_of(mine, 2),
                                 std::filesystem::copy_options::overwrite_existing);
    comm.barrier();
    expect(comm, ddp::Errc::mismatch, "was written by rank 1 of 2 ranks",
           [&] { (void)ddp::load_sharded_checkpoint(comm, path); });
    // The ranks have no generation in common.
    (void)ddp::save_sharded_checkpoint(comm, ck, path);  // generation 3
    comm.barrier();
    if (comm.rank() == 1) {
      const std::string third = file_of(mine, 3);
      std::filesystem::rename(third, mine + ".50" + third.substr(third.rfind('.')));
    }
    comm.barrier();
    expect(comm, ddp::Errc::mismatch,
           "no save has a file of every rank: the newest, generation 50 of 2 ranks, has the files "
           "of rank 1 but none of rank 0",
           [&] { (void)ddp::load_sharded_checkpoint(comm, path); });
    // One rank's files missing.
    if (comm.rank() == 1) std::filesystem::remove(file_of(mine, 50));
    comm.barrier();
    expect(comm, ddp::Errc::mismatch,
           "generation 3 of 2 ranks, has the files of rank 0 but none of rank 1",
           [&] { (void)ddp::load_sharded_checkpoint(comm, path); });
  });
  // ShardedAverager::load refuses a set of another model, and one saved without parameters (by
  // save_sharded_checkpoint alone).
  mp::run(2, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    Net net;
    {
      ddp::ShardedAverager zero(comm, net, sharded_options);
      zero.save(dir.file("z"));
      MP_EXPECT(zero.load(dir.file("z")).has_value(), "its own checkpoint");
    }
    Net odd;
    odd.params[3] = {std::vector<float>(5), std::vector<float>(5)};
    ddp::ShardedAverager other(comm, odd, sharded_options);
    expect(comm, ddp::Errc::mismatch,
           "the checkpoint holds 7 parameters and this model 7; parameter 3 has 129 elements in "
           "the checkpoint but 5 here: it was saved with another model",
           [&] { (void)other.load(dir.file("z")); });
    ddp::ShardedAverager zero(comm, net, sharded_options);
    ddp::Checkpoint ck;
    (void)ddp::save_sharded_checkpoint(comm, ck, dir.file("plain"));
    expect(comm, ddp::Errc::mismatch, "holds no parameters",
           [&] { (void)zero.load(dir.file("plain")); });
    // A path whose directory does not exist is a mistake, not a fresh start.
    expect(comm, ddp::Errc::invalid_argument, "does not exist; create it, or correct the path",
           [&] { (void)zero.load(dir.file("no/such/dir/z")); });
    expect(comm, ddp::Errc::invalid_argument, "does not exist; create it, or correct the path",
           [&] { (void)ddp::load_checkpoint(comm, dir.file("no/such/dir/z")); });
    // An update without averaging: gather() refuses.
    backward(net, comm.rank(), 0);
    mp::expect_refused(comm, "gather without synchronize", "synchronize() has not run",
                       [&] { zero.gather(); });
  });
  // Three ranks find an incomplete set of two: refused, not a fresh start.
  mp::run(3, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    expect(comm, ddp::Errc::mismatch, "generation 3 of 2 ranks, has the files of rank 0 but none",
           [&] { (void)ddp::load_sharded_checkpoint(comm, path); });
  });
}

TEST_CASE(
    "sharded: AsyncShardedSaver writes every rank's part while collectives go on, completes at "
    "wait(), and its saves load at this world size and another") {
  mp::TempDir dir;
  const std::string path = dir.file("a");
  mp::run(3, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    ddp::AsyncShardedSaver saver;
    MP_EXPECT(!saver.pending(), "a new saver has nothing in flight");
    std::uint64_t last = 0;
    for (int step = 1; step <= 3; ++step) {
      ddp::Checkpoint ck;
      ck.put_object("step", step);
      std::vector<float> part(1000 + static_cast<std::size_t>(comm.rank()),
                              static_cast<float>(10 * step + comm.rank()));
      ck.put_sharded(
          "m", part,
          ddp::ShardLayout{
              {3003},
              {{0, static_cast<std::size_t>(comm.rank()) * 1000 + (comm.rank() > 1 ? 1 : 0),
                part.size()}}});
      last = saver.save(comm, std::move(ck), path);  // completes the save before it
      MP_EXPECT(saver.pending(), "a save in flight");
      std::vector<double> v(1 << 16, 1.0);  // training meanwhile
      comm.all_reduce(v);
      MP_EXPECT(v[0] == 3.0, v[0]);
    }
    saver.wait(comm);
    MP_EXPECT(!saver.pending(), "wait() completed the save");
    saver.wait(comm);  // nothing in flight: a no-op on every rank
    const auto back = ddp::load_sharded_checkpoint(comm, path);
    MP_EXPECT(back && back->get_object<int>("step") == 3 && ddp::shard_save_id(*back) == last,
              "the last save, complete");
    // The older generations went once the last one was complete everywhere: one file per rank.
    int files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path))
      files += e.path().filename().string().rfind("a.rank" + std::to_string(comm.rank()), 0) == 0;
    MP_EXPECT(files == 1, files << " files of rank " << comm.rank());
    // A save whose directory does not exist fails on every rank (at save() or at wait()).
    try {
      (void)saver.save(comm, ddp::Checkpoint{}, dir.file("no/such/dir/a"));
      saver.wait(comm);
      MP_EXPECT(false, "a save into a missing directory was accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument || e.code() == ddp::Errc::system, e.what());
    }
  });
  mp::run(2, ddp::HostTransport::shm, [&](mp::Comm& comm) {  // another world size
    const auto back = ddp::load_sharded_checkpoint(comm, path);
    MP_EXPECT(back && back->get_object<int>("step") == 3, "loads at 2 ranks");
    std::vector<float> m(back->get("m").size() / sizeof(float));
    std::memcpy(m.data(), back->get("m").data(), back->get("m").size());
    MP_EXPECT(m.size() == (comm.rank() == 0 ? 1502u : 1501u), m.size());
    // Old rank 0's 1000 values (30), rank 1's 1001 (31), rank 2's 1002 (32), cut in two halves.
    const float first = comm.rank() == 0 ? 30.0f : 31.0f;
    MP_EXPECT(m.front() == first && m.back() == (comm.rank() == 0 ? 31.0f : 32.0f),
              m.front() << " " << m.back());
  });
}

TEST_CASE("sharded: after a peer is lost mid-step, every later call fails cleanly") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    Net net;
    ddp::ShardedAverager zero(comm, net, sharded_options);
    backward(net, comm.rank(), 0);
    if (comm.rank() == 2) std::_Exit(0);  // gone without a word, mid-step
    for (int attempt = 0; attempt < 3; ++attempt) {
      try {
        if (attempt < 2)
          zero.average();  // the second time: a new step on a communicator that failed
        else
          zero.gather();
        MP_EXPECT(false, "a step without rank 2 succeeded");
      } catch (const ddp::Error& e) {
        const bool expected = e.code() == ddp::Errc::peer_lost || e.code() == ddp::Errc::aborted ||
                              e.code() == ddp::Errc::invalid_argument;  // gather: no average
        MP_EXPECT(expected, "attempt " << attempt << ": " << e.what());
      }
    }
  });
}

namespace {
std::vector<float> flat(const std::vector<std::vector<float>>& per_range) {
  std::vector<float> out;
  for (const auto& r : per_range) out.insert(out.end(), r.begin(), r.end());
  return out;
}
// The whole state (parameters, Adam's m and v) per parameter element, as bytes: what every rank
// of any world size must find at its pieces after a load.
struct Whole {
  std::vector<std::vector<float>> value, m, v;
};
template <class Zero>
void check_against(mp::Comm& comm, Zero& zero, const Net& net, const ddp::Checkpoint& ck,
                   const Whole& whole) {
  for (std::size_t i = 0; i < net.params.size(); ++i)
    MP_EXPECT(net.params[i].value == whole.value[i], "parameter " << i << " differs after load");
  std::vector<float> m(zero.shard_size()), v(zero.shard_size());
  ck.get_values("m", std::span(m));
  ck.get_values("v", std::span(v));
  MP_EXPECT(ck.sharded_layout("m") == zero.layout(), "m is not in the averager's layout");
  std::size_t at = 0;
  for (const auto& s : zero.shard()) {
    for (std::size_t k = 0; k < s.value.size; ++k, ++at) {
      MP_EXPECT(m[at] == whole.m[s.param][s.offset + k] && v[at] == whole.v[s.param][s.offset + k],
                "rank " << comm.rank() << " of " << comm.size() << ": state of parameter "
                        << s.param << "[" << s.offset + k << "] differs");
    }
  }
  MP_EXPECT(ck.get_object<int>("t") == 7, "the step count");
}
}  // namespace

TEST_CASE("sharded: checkpoints saved at 1, 2, 3, 4 ranks load at every other, Adam state too") {
  for (int saved : {1, 2, 3, 4}) {
    CAPTURE(saved);
    mp::TempDir dir;
    const std::string path = dir.file("z"), whole_path = dir.file("whole");
    mp::run(saved, ddp::HostTransport::shm, [&](mp::Comm& comm) {
      Net net;
      Optimizer opt(true);
      ddp::ShardedAverager zero(comm, net, sharded_options);
      for (int step = 0; step < 7; ++step) {
        backward(net, comm.rank(), step);
        zero.step([&](auto shard) { opt.step(ranges(shard)); });
      }
      ddp::Checkpoint state;
      state.put_sharded("m", flat(opt.m), zero.layout())
          .put_sharded("v", flat(opt.v), zero.layout());
      state.put_object("t", opt.t);
      zero.save(state, path);
      // The unsharded truth, from every rank's pieces.
      Whole whole;
      for (const auto& p : net.params) {
        whole.value.push_back(p.value);
        whole.m.emplace_back(p.value.size(), -1.0f);
        whole.v.emplace_back(p.value.size(), -1.0f);
      }
      using Pieces = std::vector<std::pair<std::vector<std::uint64_t>, std::vector<float>>>;
      Pieces mine;
      std::size_t j = 0;
      for (const auto& s : zero.shard()) {
        mine.push_back({{s.param, s.offset, 0}, opt.m[j]});
        mine.push_back({{s.param, s.offset, 1}, opt.v[j++]});
      }
      for (const Pieces& pieces : comm.all_gather_object(mine))
        for (const auto& [where, values] : pieces)
          std::copy(values.begin(), values.end(),
                    (where[2] == 0 ? whole.m : whole.v)[where[0]].begin() +
                        static_cast<std::ptrdiff_t>(where[1]));
      if (comm.rank() == 0) {
        ddp::Checkpoint w;
        w.put_object("value", whole.value).put_object("m", whole.m).put_object("v", whole.v);
        w.save(whole_path);
      }
    });
    const auto truth = ddp::Checkpoint::load(whole_path);
    REQUIRE(truth.has_value());
    const Whole whole{truth->get_object<std::vector<std::vector<float>>>("value"),
                      truth->get_object<std::vector<std::vector<float>>>("m"),
                      truth->get_object<std::vector<std::vector<float>>>("v")};
    for (int loaded : {1, 2, 3, 4}) {
      CAPTURE(loaded);
      mp::run(loaded, loaded == 3 ? ddp::HostTransport::tcp : ddp::HostTransport::shm,
              [&](mp::Comm& comm) {
                Net net;  // other values than the saved ones, so the load must put them back
                for (auto& p : net.params) std::fill(p.value.begin(), p.value.end(), 9.0f);
                ddp::ShardedAverager zero(comm, net, sharded_options);
                const auto ck = zero.load(path);
                MP_EXPECT(ck.has_value(), "nothing loaded");
                if (ck) check_against(comm, zero, net, *ck, whole);
                // Other BucketOptions: another shard, the same state.
                ddp::BucketOptions other = sharded_options;
                other.bucket_bytes = 4096;
                Net again;
                ddp::ShardedAverager zero2(comm, again, other);
                const auto ck2 = zero2.load(path);
                if (ck2) check_against(comm, zero2, again, *ck2, whole);
                MP_EXPECT(ck2.has_value(), "nothing loaded with other options");
              });
    }
  }
}

namespace {

// Optimizer state for zero's shard from a checkpoint's sharded sections "m" and "v".
template <class Zero>
Optimizer optimizer_from(const ddp::Checkpoint& ck, Zero& zero) {
  Optimizer opt(true);
  std::vector<float> m(zero.shard_size()), v(zero.shard_size());
  ck.get_values("m", std::span(m));
  ck.get_values("v", std::span(v));
  opt.t = ck.get_object<int>("t");
  std::size_t at = 0;
  for (const auto& s : zero.shard()) {
    const auto from = static_cast<std::ptrdiff_t>(at),
               to = from + static_cast<std::ptrdiff_t>(s.value.size);
    opt.m.emplace_back(m.begin() + from, m.begin() + to);
    opt.v.emplace_back(v.begin() + from, v.begin() + to);
    at += s.value.size;
  }
  return opt;
}

// Adam steps [from, 12) with a sharded save after every third; `die`: this rank exits at the
// start of step 8. After a loss: shrink(), a new averager over the survivors, the last save
// loaded at their size (resharded), and on.
void sharded_run(mp::Comm& comm, Net& net, const std::string& path, int die) {
  Optimizer opt(true);
  std::optional<ddp::ShardedAverager<Net, ddp::backend::Host>> zero;
  zero.emplace(comm, net, sharded_options);
  int step = 0;
  if (const auto ck = zero->load(path)) {
    opt = optimizer_from(*ck, *zero);
    step = opt.t;
  }
  for (;;) {
    try {
      for (; step < 12; ++step) {
        if (comm.rank() == die && step == 8 && comm.epoch() == 0) std::_Exit(5);
        backward(net, comm.rank(), step);
        zero->step([&](auto shard) { opt.step(ranges(shard)); });
        if ((step + 1) % 3 != 0) continue;
        ddp::Checkpoint state;
        state.put_sharded("m", flat(opt.m), zero->layout())
            .put_sharded("v", flat(opt.v), zero->layout());
        state.put_object("t", opt.t);
        zero->save(state, path);
      }
      return;
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::peer_lost || e.code() == ddp::Errc::aborted, e.what());
      comm = comm.shrink({.wait_for_ranks = std::chrono::seconds(10)});
      zero.emplace(comm, net, sharded_options);  // shards for the survivors
      const auto ck = zero->load(path);          // saved by 4 ranks, loaded by 3
      MP_EXPECT(ck.has_value(), "no checkpoint to resume from");
      if (!ck) return;
      opt = optimizer_from(*ck, *zero);
      step = opt.t;
    }
  }
}

}  // namespace

TEST_CASE(
    "sharded: a rank lost mid-run, the survivors shrink and resume from the last sharded "
    "checkpoint, resharded over them") {
  // The run with a loss: 4 ranks save after steps 3 and 6; rank 2 dies at step 9; the three
  // others resume at step 7 from the save of 4 ranks. The reference: 4 ranks to step 6, then
  // 3 fresh processes loading that save. Every survivor ends bitwise equal to the reference.
  mp::TempDir dir;
  const std::string path = dir.file("z");
  mp::run_with_losses([&](mp::Comm& comm, int first) {
    Net net;
    sharded_run(comm, net, path, 2);
    MP_EXPECT(comm.size() == 3, "the survivors");
    mp::TempDir::write(dir.file("net" + std::to_string(first)), bytes_of(net));
  });
  mp::TempDir again;  // the reference: 4 ranks to step 6 and a save, then 3 from it
  const std::string ref6 = again.file("z");
  mp::run(4, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    Net net;
    Optimizer opt(true);
    ddp::ShardedAverager zero(comm, net, sharded_options);
    for (int step = 0; step < 6; ++step) {
      backward(net, comm.rank(), step);
      zero.step([&](auto shard) { opt.step(ranges(shard)); });
    }
    ddp::Checkpoint state;
    state.put_sharded("m", flat(opt.m), zero.layout()).put_sharded("v", flat(opt.v), zero.layout());
    state.put_object("t", opt.t);
    zero.save(state, ref6);
  });
  mp::run(3, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    Net net;
    sharded_run(comm, net, ref6, 99);
    mp::TempDir::write(again.file("ref" + std::to_string(comm.rank())), bytes_of(net));
  });
  const std::string want = mp::TempDir::read(again.file("ref0"));
  REQUIRE(!want.empty());
  for (int r : {0, 1, 3})
    CHECK_MESSAGE(mp::TempDir::read(dir.file("net" + std::to_string(r))) == want,
                  "survivor " << r << " differs from the reference");
}

namespace {

/// The optimizer's state for the shard, as save() takes it.
template <class Zero>
ddp::Checkpoint optimizer_state(const Optimizer& opt, Zero& zero) {
  ddp::Checkpoint state;
  state.put_sharded("m", flat(opt.m), zero.layout()).put_sharded("v", flat(opt.v), zero.layout());
  state.put_object("t", opt.t);
  return state;
}

/// 12 steps, each saved to an in-memory mirror (tag: the steps done); the ranks in `die` (of
/// the first communicator) end at the start of step 8, or after its update, before its save,
/// when `in_save`. After a loss: shrink(), a new averager, the newest save the survivors hold
/// (its refusal, when a shard has no copy left, in `refused`).
void mirrored_run(mp::Comm& comm, Net& net, const std::vector<int>& die, bool in_save,
                  std::uint64_t& resumed_at, std::string& refused, int then = -1) {
  Optimizer opt(true);
  ddp::ShardMirror mirror;
  std::optional<ddp::ShardedAverager<Net, ddp::backend::Host>> zero;
  zero.emplace(comm, net, sharded_options);
  const bool victim =
      comm.epoch() == 0 && std::find(die.begin(), die.end(), comm.rank()) != die.end();
  const int first = comm.rank();
  int step = 0;
  for (;;) {
    try {
      for (; step < 12; ++step) {
        if (victim && step == 8 && !in_save && comm.epoch() == 0) std::_Exit(5);
        // `then` (a first rank) dies in the first step after the recovery, before its save.
        if (first == then && step == 8 && comm.epoch() == 1) std::_Exit(5);
        backward(net, comm.rank(), step);
        zero->step([&](auto shard) { opt.step(ranges(shard)); });
        if (victim && step == 8 && in_save && comm.epoch() == 0) {
          // Killed while the others exchange this step's copies: its own never leaves.
          std::_Exit(5);
        }
        zero->save(optimizer_state(opt, *zero), mirror, static_cast<std::uint64_t>(step + 1));
      }
      return;
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::peer_lost || e.code() == ddp::Errc::aborted, e.what());
      comm = comm.shrink({.wait_for_ranks = std::chrono::seconds(10)});
      zero.emplace(comm, net, sharded_options);  // shards for the survivors
      std::optional<ddp::Checkpoint> ck;
      try {
        ck = zero->load(mirror);  // the newest save of which every shard is held
      } catch (const ddp::Error& lost) {
        if (lost.code() != ddp::Errc::mismatch) throw;
        refused = lost.what();
        return;
      }
      MP_EXPECT(ck.has_value(), "no save in memory to resume from");
      if (!ck) return;
      opt = optimizer_from(*ck, *zero);
      step = opt.t;
      resumed_at = static_cast<std::uint64_t>(step);
    }
  }
}

/// The reference: 4 ranks to `done` steps and a save to a file, then `survivors` fresh processes
/// from it to step 12; returns rank 0's parameters.
std::string reference_from(int done, int survivors) {
  mp::TempDir dir;
  const std::string path = dir.file("z");
  mp::run(4, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    Net net;
    Optimizer opt(true);
    ddp::ShardedAverager zero(comm, net, sharded_options);
    for (int step = 0; step < done; ++step) {
      backward(net, comm.rank(), step);
      zero.step([&](auto shard) { opt.step(ranges(shard)); });
    }
    zero.save(optimizer_state(opt, zero), path);
  });
  mp::run(survivors, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    Net net;
    sharded_run(comm, net, path, 99);
    mp::TempDir::write(dir.file("ref" + std::to_string(comm.rank())), bytes_of(net));
  });
  return mp::TempDir::read(dir.file("ref0"));
}

}  // namespace

TEST_CASE(
    "sharded: with each shard copied in memory to the rank before it, a lost rank loses no "
    "step, and two lost neighbours are refused naming the shard") {
  // Rank D of 4 dies at the start of step 8 (the mirror holds the save after 8 steps) or inside
  // step 8's save (its copy never arrives: the survivors take the save after 8 steps too, the
  // older one kept). The reference: 4 ranks to step 8, a file, 3 fresh processes from it.
  const std::string want = reference_from(8, 3);
  REQUIRE(!want.empty());
  struct Case {
    std::vector<int> die;
    bool in_save;
  };
  for (const Case& c : {Case{{2}, false}, Case{{0}, false}, Case{{3}, true}, Case{{1, 3}, false},
                        Case{{1, 2}, false}}) {
    CAPTURE(c.die.front());
    CAPTURE(c.die.back());
    CAPTURE(c.in_save);
    mp::TempDir dir;
    mp::run_with_losses([&](mp::Comm& comm, int first) {
      Net net;
      std::uint64_t resumed = 0;
      std::string refused;
      mirrored_run(comm, net, c.die, c.in_save, resumed, refused);
      if (!refused.empty()) {
        mp::TempDir::write(dir.file("refused" + std::to_string(first)), refused);
        return;
      }
      MP_EXPECT(resumed == 8, "resumed after " << resumed << " steps, not 8");
      mp::TempDir::write(dir.file("net" + std::to_string(first)), bytes_of(net));
    });
    const bool neighbours = c.die.size() == 2 && c.die[1] == c.die[0] + 1;
    for (int r = 0; r < 4; ++r) {
      if (std::find(c.die.begin(), c.die.end(), r) != c.die.end()) continue;
      if (neighbours) {  // rank 2's shard was on rank 2 and, copied, on rank 1: both lost
        const std::string why = mp::TempDir::read(dir.file("refused" + std::to_string(r)));
        CHECK_MESSAGE(why.find("no rank holds a copy of rank 2's shard") != std::string::npos,
                      "survivor " << r << ": " << why);
        continue;
      }
      const std::string expected = c.die.size() == 1 ? want : reference_from(8, 2);
      CHECK_MESSAGE(mp::TempDir::read(dir.file("net" + std::to_string(r))) == expected,
                    "survivor " << r << " differs from the reference");
    }
  }
}

TEST_CASE(
    "sharded: a second loss in the first step after a recovery loses no step: the loaded state "
    "is mirrored again on the new world before training goes on") {
  // Rank 2 of 4 dies at the start of step 8; the survivors load the save after 8 steps (rank 2's
  // shard from rank 1's copy) and, in that same step 8 on 3 ranks, rank 1 dies before its save:
  // rank 2's old shard had its only copy on rank 1, so only the copies made on the new world
  // hold it now.
  const std::string want = reference_from(8, 2);
  REQUIRE(!want.empty());
  mp::TempDir dir;
  mp::run_with_losses([&](mp::Comm& comm, int first) {
    Net net;
    std::uint64_t resumed = 0;
    std::string refused;
    mirrored_run(comm, net, {2}, false, resumed, refused, 1);
    MP_EXPECT(refused.empty(), refused);
    MP_EXPECT(resumed == 8, "resumed after " << resumed << " steps, not 8");
    MP_EXPECT(comm.size() == 2, "the survivors");
    mp::TempDir::write(dir.file("net" + std::to_string(first)), bytes_of(net));
  });
  for (int r : {0, 3})
    CHECK_MESSAGE(mp::TempDir::read(dir.file("net" + std::to_string(r))) == want,
                  "survivor " << r << " differs from the reference");
}

TEST_CASE("sharded: in-memory copies refuse tags or unsharded state that differ between ranks") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    Net net;
    ddp::ShardMirror mirror;
    ddp::ShardedAverager zero(comm, net, sharded_options);
    MP_EXPECT(!zero.load(mirror).has_value(), "an empty mirror loads nothing");
    const auto refused = [&](auto&& save, const std::string& says) {
      try {
        save();
        MP_EXPECT(false, "saved: " << says);
      } catch (const ddp::Error& e) {
        MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                      std::string(e.what()).find(says) != std::string::npos,
                  e.what());
      }
    };
    refused([&] { zero.save(mirror, 5 + static_cast<std::uint64_t>(comm.rank() == 2)); },
            "rank 2 saves tag 6 but rank 0 tag 5");
    ddp::Checkpoint state;
    state.put_object("step", comm.rank() == 1 ? 8 : 7);
    refused([&] { zero.save(state, mirror, 7); }, "section \"step\" differs");
    MP_EXPECT(mirror.tags().empty(), "a refused save kept nothing");
    state.put_object("step", 7);
    zero.save(state, mirror, 7);
    zero.save(state, mirror, 8);
    refused([&] { (void)zero.load(mirror, 99); },
            "no rank holds a save tagged 99 (the ranks hold tags 7, 8");
    const auto ck = zero.load(mirror, 7);
    MP_EXPECT(ck && ck->get_object<int>("step") == 7, "the save tagged 7");
  });
}

TEST_CASE(
    "sharded checkpoint: sections cut again for another world size, what cannot be is refused") {
  mp::TempDir dir;
  const std::string path = dir.file("c");
  constexpr std::size_t n = 1003, rows = 17;
  const auto value = [](std::size_t array, std::size_t k) {
    return static_cast<double>(array * 100000 + k) + 0.25;
  };
  // Saved at 3 ranks: array 0 (n elements) evenly, array 1 (rows) all on rank 2; a step count the
  // same everywhere, a note per rank.
  const auto save = [&](mp::Comm& comm, bool per_rank_note) {
    ddp::ShardLayout l = ddp::ShardLayout::even({n, rows}, comm.rank(), comm.size());
    l.ranges.erase(std::remove_if(l.ranges.begin(), l.ranges.end(),
                                  [](const ddp::ShardRange& r) { return r.array == 1; }),
                   l.ranges.end());
    if (comm.rank() == 2) l.ranges.push_back({1, 0, rows});
    std::vector<double> values;
    for (const auto& r : l.ranges)
      for (std::size_t k = 0; k < r.size; ++k) values.push_back(value(r.array, r.offset + k));
    ddp::Checkpoint ck;
    ck.put_object("step", 41).put_sharded("table", values, l);
    if (per_rank_note) ck.put_object("note", comm.rank());
    return ddp::save_sharded_checkpoint(comm, ck, path);
  };
  mp::run(3, ddp::HostTransport::shm, [&](mp::Comm& comm) { (void)save(comm, false); });
  for (int world : {1, 2, 3, 4, 5}) {
    CAPTURE(world);
    mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {
      const auto ck = ddp::load_sharded_checkpoint(comm, path);
      MP_EXPECT(ck && ck->get_object<int>("step") == 41, "the plain section");
      if (!ck) return;
      const auto l = ck->sharded_layout("table");
      MP_EXPECT(l.has_value(), "no layout");
      if (!l) return;
      if (world != 3)
        MP_EXPECT(*l == ddp::ShardLayout::even({n, rows}, comm.rank(), world), "not even");
      std::vector<double> got(l->elements());
      ck->get_values("table", std::span(got));
      std::size_t at = 0, held = 0;
      for (const auto& r : l->ranges)
        for (std::size_t k = 0; k < r.size; ++k, ++at)
          MP_EXPECT(got[at] == value(r.array, r.offset + k),
                    "array " << r.array << "[" << r.offset + k << "]");
      held = l->elements();
      std::vector<std::uint64_t> total{held};
      comm.all_reduce(total);
      MP_EXPECT(total[0] == n + rows, total[0] << " elements held");
      // A layout of the caller's: everything on the last rank.
      const auto last = ddp::load_sharded_checkpoint(
          comm, path, [&](std::string_view, const std::vector<std::size_t>& sizes) {
            ddp::ShardLayout all{sizes, {}};
            if (comm.rank() == comm.size() - 1)
              for (std::size_t a = 0; a < sizes.size(); ++a) all.ranges.push_back({a, 0, sizes[a]});
            return all;
          });
      MP_EXPECT(last && last->get("table").size() ==
                            (comm.rank() == world - 1 ? (n + rows) * sizeof(double) : 0),
                "the caller's layout");
      // A layout that names arrays the section does not have: refused on every rank.
      try {
        (void)ddp::load_sharded_checkpoint(comm, path, [&](std::string_view, const auto&) {
          return ddp::ShardLayout{{n}, {}};
        });
        MP_EXPECT(false, "a layout of other arrays was accepted");
      } catch (const ddp::Error& e) {
        MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                      std::string(e.what()).find("has 1 arrays of other sizes than the 2") !=
                          std::string::npos,
                  e.what());
      }
    });
  }
  // A section that differs between the ranks' files can go back only to the ranks that saved it.
  mp::run(3, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    (void)save(comm, true);
    const auto ck = ddp::load_sharded_checkpoint(comm, path);
    MP_EXPECT(ck && ck->get_object<int>("note") == comm.rank(), "each rank its own note");
  });
  mp::run(2, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    try {
      (void)ddp::load_sharded_checkpoint(comm, path);
      MP_EXPECT(false, "a per-rank section was given to another world size");
    } catch (const ddp::Error& e) {
      const std::string m = e.what();
      MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                    m.find("section \"note\" differs between") != std::string::npos,
                m);
      MP_EXPECT(m.find("rank " + std::to_string(comm.rank())) == 0, m);
    }
    // A save at 2 ranks supersedes the set of 3: its files go, and 4 ranks load the new one.
    ddp::Checkpoint ck;
    ck.put_sharded("table", std::vector<double>(3, 1.5 + comm.rank()),
                   ddp::ShardLayout{{6}, {{0, 3 * static_cast<std::size_t>(comm.rank()), 3}}});
    (void)ddp::save_sharded_checkpoint(comm, ck, path);
  });
  // Pieces that overlap (each rank claims the whole array) or leave a gap cannot be cut again.
  for (const bool overlap : {true, false}) {
    mp::TempDir other;
    const std::string bad = other.file("bad");
    mp::run(2, ddp::HostTransport::shm, [&](mp::Comm& comm) {
      const std::size_t first = overlap ? 0 : 6 * static_cast<std::size_t>(comm.rank());
      ddp::Checkpoint ck;
      ck.put_sharded("t", std::vector<float>(5, 1.0f),
                     ddp::ShardLayout{{overlap ? 5u : 11u}, {{0, first, 5}}});
      (void)ddp::save_sharded_checkpoint(comm, ck, bad);
    });
    mp::run(3, ddp::HostTransport::shm, [&](mp::Comm& comm) {
      try {
        (void)ddp::load_sharded_checkpoint(comm, bad);
        MP_EXPECT(false,
                  "pieces that " << (overlap ? "overlap" : "leave a gap") << " were cut again");
      } catch (const ddp::Error& e) {
        MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                      std::string(e.what()).find("exactly once") != std::string::npos,
                  e.what());
      }
    });
  }
  std::size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    const std::string name = e.path().filename().string();
    files += name.rfind("c.rank", 0) == 0 ? 1u : 0u;
    CHECK_MESSAGE(name.find("-of-3") == std::string::npos, name << " was not removed");
  }
  CHECK(files == 2);
  mp::run(4, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    const auto ck = ddp::load_sharded_checkpoint(comm, path);
    std::vector<double> got(2 - (comm.rank() >= 2 ? 1 : 0));
    if (ck) ck->get_values("table", std::span(got));
    const double want[] = {1.5, 1.5, 1.5, 2.5, 2.5, 2.5};
    const std::size_t first = comm.rank() < 2 ? 2 * static_cast<std::size_t>(comm.rank())
                                              : 4 + static_cast<std::size_t>(comm.rank()) - 2;
    for (std::size_t k = 0; k < got.size(); ++k) MP_EXPECT(got[k] == want[first + k], k);
  });
}

}  // namespace sharded_tests
