#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/data/partition.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "multiprocess.hpp"

namespace {

std::string error_of(const auto& fn) {
  try {
    fn();
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
    return e.what();
  }
  return "";
}

// Every rank's indices of one epoch.
std::vector<std::vector<std::size_t>> shards(std::size_t n, int ranks, ddp::SamplerOptions o,
                                             std::uint64_t epoch = 0) {
  std::vector<std::vector<std::size_t>> all;
  for (int r = 0; r < ranks; ++r) {
    ddp::DistributedSampler s(n, ranks, r, o);
    s.set_epoch(epoch);
    all.push_back(s.indices());
    CHECK(all.back().size() == s.size());
  }
  return all;
}

}  // namespace

TEST_CASE("partition: the PRNG and the shuffle are the specified ones") {
  // SplitMix64's published outputs for seed 0, and permutations computed by an independent
  // (Python) implementation of the documented algorithm: any standard library gives these.
  ddp::detail::SplitMix64 r(0);
  CHECK(r.next() == 0xE220A8397B1DCDAFull);
  CHECK(r.next() == 0x6E789E6AA1B965F4ull);
  CHECK(r.next() == 0x06C45D188009454Full);
  CHECK(ddp::detail::permutation(10, 42) == std::vector<std::size_t>{8, 3, 6, 5, 4, 0, 9, 2, 1, 7});
  CHECK(ddp::detail::permutation(12, 1237) ==
        std::vector<std::size_t>{1, 0, 6, 2, 4, 3, 7, 10, 9, 5, 8, 11});
  CHECK(ddp::detail::permutation(0, 1).empty());
  CHECK(ddp::detail::permutation(1, 1) == std::vector<std::size_t>{0});
  ddp::detail::SplitMix64 b(7);
  for (int i = 0; i < 1000; ++i) CHECK(b.below(3) < 3);
  // Roughly uniform: each of 4 values about a quarter of 40000 draws.
  std::vector<int> counts(4);
  for (int i = 0; i < 40000; ++i) ++counts[b.below(4)];
  for (int c : counts) CHECK(std::abs(c - 10000) < 600);
}

TEST_CASE("partition: DataPartitioner cuts one shuffled order into disjoint parts") {
  std::vector<int> data(103);
  std::iota(data.begin(), data.end(), 1000);
  ddp::DataPartitioner part(data, {0.5, 0.25, 0.25}, 1234);
  REQUIRE(part.parts() == 3);
  std::set<int> seen;
  const std::size_t sizes[] = {51, 25, 25};
  for (std::size_t i = 0; i < 3; ++i) {
    const auto p = part.use(i);
    CHECK(p.size() == sizes[i]);
    std::size_t k = 0;
    for (int v : p) {  // iteration and operator[] agree, and every value is new
      CHECK(v == p[k]);
      CHECK(v == data[p.indices()[k]]);
      CHECK(seen.insert(v).second);
      ++k;
    }
    CHECK(k == p.size());
  }
  // The same seed gives the same parts on every rank; another seed another order.
  ddp::DataPartitioner again(data, {0.5, 0.25, 0.25}, 1234);
  ddp::DataPartitioner other(data, {0.5, 0.25, 0.25}, 99);
  const auto a = part.use(0).indices(), b = again.use(0).indices(), c = other.use(0).indices();
  CHECK(std::equal(a.begin(), a.end(), b.begin(), b.end()));
  CHECK_FALSE(std::equal(a.begin(), a.end(), c.begin(), c.end()));
  // Equal parts, one per rank.
  ddp::DataPartitioner equal(data, 4);
  for (int r = 0; r < 4; ++r) CHECK(equal.use(r).size() == 25);
  // A view outlives its partitioner.
  auto view = [&] { return ddp::DataPartitioner(data, {1.0}).use(0); }();
  CHECK(view.size() == 103);
  CHECK(view.at(102) == view[102]);
}

TEST_CASE("partition: DataPartitioner refuses bad fractions and parts") {
  std::vector<int> data(10);
  CHECK(error_of([&] {
          ddp::DataPartitioner p(data, {0.5, 0.6});
        }).find("sum to 1.1") != std::string::npos);
  CHECK(error_of([&] {
          ddp::DataPartitioner p(data, {0.5, -0.1});
        }).find("fraction 1 is -0.1; each must be in (0, 1]") != std::string::npos);
  CHECK(error_of([&] {
          ddp::DataPartitioner p(data, {0.5, 0.0 / 0.0});
        }).find("fraction 1") != std::string::npos);
  CHECK(error_of([&] {
          ddp::DataPartitioner p(data, std::vector<double>{});
        }).find("no fractions") != std::string::npos);
  CHECK(error_of([&] { ddp::DataPartitioner p(data, 0); }).find("0 parts") != std::string::npos);
  ddp::DataPartitioner p(data, {0.5, 0.5});
  CHECK(error_of([&] { (void)p.use(2); }).find("there are 2 parts") != std::string::npos);
  CHECK(error_of([&] { (void)p.use(-1); }).find("negative") != std::string::npos);
  CHECK(error_of([&] { (void)p.use(0).at(5); }).find("out of range") != std::string::npos);
}

TEST_CASE("partition: DistributedSampler pads, cuts or splits exactly, like torch and beyond") {
  for (std::size_t n : {0u, 1u, 5u, 7u, 10u, 101u}) {
    for (int ranks : {1, 2, 3, 4}) {
      CAPTURE(n);
      CAPTURE(ranks);
      const auto r = static_cast<std::size_t>(ranks);
      for (bool shuffle : {false, true}) {
        // Padded (torch's default): ceil(n / R) each, every index present, wrap-around repeats.
        auto padded = shards(n, ranks, {.shuffle = shuffle, .seed = 3});
        std::multiset<std::size_t> all;
        for (const auto& s : padded) {
          CHECK(s.size() == (n + r - 1) / r);
          all.insert(s.begin(), s.end());
        }
        for (std::size_t i = 0; i < n; ++i) CHECK(all.count(i) >= 1);
        CHECK(all.size() == (n + r - 1) / r * r);
        // drop_last: floor(n / R) each, all distinct.
        auto cut = shards(n, ranks, {.shuffle = shuffle, .seed = 3, .drop_last = true});
        std::set<std::size_t> distinct;
        for (const auto& s : cut) {
          CHECK(s.size() == n / r);
          distinct.insert(s.begin(), s.end());
        }
        CHECK(distinct.size() == n / r * r);
        // exact: every index exactly once; shard sizes differ by at most one.
        auto exact = shards(n, ranks, {.shuffle = shuffle, .seed = 3, .exact = true});
        std::multiset<std::size_t> once;
        std::size_t lo = n, hi = 0;
        for (const auto& s : exact) {
          once.insert(s.begin(), s.end());
          lo = std::min(lo, s.size());
          hi = std::max(hi, s.size());
        }
        CHECK(once.size() == n);
        for (std::size_t i = 0; i < n; ++i) CHECK(once.count(i) == 1);
        CHECK(hi - std::min(lo, hi) <= 1);
      }
      // Without shuffling, rank k takes k, k + R, ... (torch's indices[rank::R]).
      auto plain = shards(n, ranks, {.shuffle = false, .exact = true});
      for (int k = 0; k < ranks; ++k) {
        for (std::size_t j = 0; j < plain[static_cast<std::size_t>(k)].size(); ++j)
          CHECK(plain[static_cast<std::size_t>(k)][j] == static_cast<std::size_t>(k) + j * r);
      }
    }
  }
  // The epoch changes the order; the same epoch repeats it.
  CHECK(shards(100, 2, {.seed = 5}, 1) != shards(100, 2, {.seed = 5}, 2));
  CHECK(shards(100, 2, {.seed = 5}, 1) == shards(100, 2, {.seed = 5}, 1));
  CHECK(shards(100, 2, {.seed = 5}, 1) != shards(100, 2, {.seed = 6}, 1));
}

TEST_CASE("partition: DistributedSampler resumes mid-epoch and checks its arguments") {
  ddp::DistributedSampler s(50, 3, 1, {.seed = 11});
  s.set_epoch(4);
  const auto full = s.indices();
  const ddp::SamplerState saved = s.state(6);  // 6 samples consumed when the checkpoint was taken
  ddp::DistributedSampler resumed(50, 3, 1, {.seed = 11});
  resumed.restore(saved);
  CHECK(resumed.epoch() == 4);
  CHECK(resumed.indices() == std::vector<std::size_t>(full.begin() + 6, full.end()));
  CHECK(resumed.state(2).offset == 8);
  resumed.set_epoch(5);  // the next epoch starts from its beginning
  CHECK(resumed.indices().size() == s.size());

  CHECK(error_of([] { ddp::DistributedSampler x(10, 0, 0); }).find("num_replicas is 0") !=
        std::string::npos);
  CHECK(error_of([] { ddp::DistributedSampler x(10, 2, 2); }).find("rank 2 is out of range") !=
        std::string::npos);
  CHECK(error_of([] {
          ddp::DistributedSampler x(10, 2, 0, {.drop_last = true, .exact = true});
        }).find("exclude each other") != std::string::npos);
  ddp::DistributedSampler other(51, 3, 1, {.seed = 11});
  CHECK(error_of([&] { other.restore(saved); }).find("50 samples") != std::string::npos);
  auto too_far = saved;
  too_far.offset = 100;
  CHECK(error_of([&] { resumed.restore(too_far); }).find("past the 17 samples") !=
        std::string::npos);
}

TEST_CASE("partition: every rank computes the same order, exact_mean weighs uneven shards") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    ddp::DistributedSampler s(1000, comm.size(), comm.rank(), {.seed = 9, .exact = false});
    s.set_epoch(3);
    const auto mine = s.indices();
    const auto all = comm.all_gather_object(mine);
    std::set<std::size_t> seen;
    for (const auto& shard : all) seen.insert(shard.begin(), shard.end());
    MP_EXPECT(seen.size() == 1000, "indices over the ranks: " << seen.size());
    // Each rank recomputes every shard locally: the same lists the owners sent.
    for (int r = 0; r < comm.size(); ++r) {
      ddp::DistributedSampler o(1000, comm.size(), r, {.seed = 9});
      o.set_epoch(3);
      MP_EXPECT(o.indices() == all[static_cast<std::size_t>(r)], "rank " << r << " differs");
    }
    // Exact evaluation over 10 samples (values 0..9) on 3 ranks: shards of 4, 3 and 3.
    ddp::DistributedSampler eval(10, comm.size(), comm.rank(), {.shuffle = false, .exact = true});
    double sum = 0;
    for (std::size_t i : eval.indices()) sum += static_cast<double>(i);
    const double mean = ddp::exact_mean(comm, sum, eval.size());
    MP_EXPECT(mean == 4.5, "exact mean " << mean);
  });
}

namespace {
// Every rank of a world of `ranks` samplers takes `steps` of its indices (all it has when its
// shard is shorter); returns them, all ranks together.
std::vector<std::size_t> take(std::vector<ddp::DistributedSampler>& world, std::size_t steps) {
  std::vector<std::size_t> out;
  for (auto& s : world) {
    const auto mine = s.indices();
    out.insert(out.begin(), mine.begin(),
               mine.begin() + static_cast<std::ptrdiff_t>(std::min(steps, mine.size())));
  }
  return out;
}
std::vector<ddp::DistributedSampler> repartitioned(const ddp::DistributedSampler& survivor,
                                                   int ranks, std::size_t consumed) {
  std::vector<ddp::DistributedSampler> out;
  for (int r = 0; r < ranks; ++r) {
    ddp::DistributedSampler s = survivor;
    s.repartition(ranks, r, consumed);
    out.push_back(s);
  }
  return out;
}
}  // namespace

TEST_CASE("partition: an epoch dealt again over fewer or more ranks sees every sample once") {
  for (const bool shuffle : {false, true}) {
    CAPTURE(shuffle);
    const std::size_t n = 1003;
    const ddp::SamplerOptions exact{.shuffle = shuffle, .seed = 5, .exact = true};
    std::vector<ddp::DistributedSampler> world;
    for (int r = 0; r < 4; ++r) world.emplace_back(n, 4, r, exact);
    for (auto& s : world) s.set_epoch(2);
    // 4 ranks take 37 steps; rank 3 is lost; 3 ranks take 50; 5 ranks (two joined) the rest.
    std::vector<std::size_t> seen = take(world, 37);
    world = repartitioned(world[1], 3, 37);
    auto more = take(world, 50);
    seen.insert(seen.end(), more.begin(), more.end());
    // A joining rank restores a member's state from before repartition, then repartitions.
    ddp::DistributedSampler joiner(n, 3, 0, exact);
    joiner.restore(world[2].state());
    world = repartitioned(joiner, 5, 50);
    more = take(world, n);
    seen.insert(seen.end(), more.begin(), more.end());
    std::sort(seen.begin(), seen.end());
    std::vector<std::size_t> all(n);
    std::iota(all.begin(), all.end(), std::size_t{0});
    CHECK(seen == all);  // every sample exactly once
    std::size_t sizes = 0;
    for (const auto& s : world) sizes += s.size();
    CHECK(sizes == n - 37 * 4 - 50 * 3);
    // The state after a repartition goes through a checkpoint and restores the same order.
    ddp::Checkpoint ck;
    ck.put_object("sampler", world[4].state(7));
    ddp::DistributedSampler back(n, 5, 4, exact);
    back.restore(ck.get_object<ddp::SamplerState>("sampler"));
    auto want = world[4].indices();
    want.erase(want.begin(), want.begin() + 7);
    CHECK(back.indices() == want);
    // A new epoch deals over the new world from the start.
    back.set_epoch(3);
    CHECK(back.size() == n / 5 + (4 < n % 5 ? 1 : 0));
  }
  // Padded (torch's default): every sample at least once; beyond the padding of an
  // uninterrupted run, at most one extra per rank of each new world. drop_last: none twice.
  for (const bool drop_last : {false, true}) {
    CAPTURE(drop_last);
    const std::size_t n = 1001;
    std::vector<ddp::DistributedSampler> world;
    for (int r = 0; r < 4; ++r)
      world.emplace_back(n, 4, r, ddp::SamplerOptions{.seed = 1, .drop_last = drop_last});
    auto seen = take(world, 100);
    world = repartitioned(world[0], 3, 100);
    auto rest = take(world, n);
    seen.insert(seen.end(), rest.begin(), rest.end());
    std::set<std::size_t> distinct(seen.begin(), seen.end());
    if (drop_last) {
      CHECK(distinct.size() == seen.size());
      CHECK(seen.size() >= n - 3 - 2);
    } else {
      CHECK(distinct.size() == n);
      CHECK(seen.size() - n <= 3 + 2);
    }
  }
  // What cannot be dealt again is refused.
  ddp::DistributedSampler s(100, 4, 1);
  CHECK(error_of([&] { s.repartition(0, 0); }).find("rank 0 of 0 ranks") != std::string::npos);
  CHECK(error_of([&] { s.repartition(3, 3); }).find("rank 3 of 3 ranks") != std::string::npos);
  CHECK(error_of([&] {
          s.repartition(3, 0, 26);
        }).find("0 + 26 samples consumed of a shard of 25") != std::string::npos);
  CHECK(error_of([&] { s.repartition(3, 0, ~std::size_t{0}); }).find("samples consumed") !=
        std::string::npos);
  // Damaged states (from a file or a peer) are refused, not divided by zero or run for hours.
  for (const std::vector<std::uint64_t>& earlier :
       {std::vector<std::uint64_t>{0, 0}, {std::uint64_t{1} << 40, std::uint64_t{1} << 40}, {4}}) {
    auto bad = s.state();
    bad.earlier = earlier;
    CHECK(error_of([&] { s.restore(bad); }).find("a damaged state") != std::string::npos);
  }
  ddp::DistributedSampler three(100, 3, 0);
  CHECK(error_of([&] { three.restore(s.state()); }).find("restore with the old number") !=
        std::string::npos);
  // A state without earlier parts is the five numbers it always was (older checkpoints read).
  const ddp::SamplerState plain{3, 4, 5, 100, 4, {}};
  const std::string bytes = ddp::detail::encode_object(plain);
  CHECK(bytes.size() == 8 + 5 * 8);
  const auto again = ddp::detail::decode_object<ddp::SamplerState>(bytes.data(), bytes.size());
  CHECK(
      (again.epoch == 3 && again.offset == 4 && again.num_replicas == 4 && again.earlier.empty()));
}
