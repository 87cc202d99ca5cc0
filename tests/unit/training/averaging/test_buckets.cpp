// The bucket engine (ddp/training/averaging/buckets.hpp) and its comm hooks, across real processes:
// user-written hooks against the default, on several buckets, in a ddp::Join, the built-in
// compression hooks, a hook that fails, and ShardedAverager with a hook of its own.
#include <ddp/training/averaging/buckets.hpp>
#include <ddp/training/averaging/gradient.hpp>
#include <ddp/training/averaging/join.hpp>
#include <ddp/training/zero/sharded.hpp>

#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "multiprocess.hpp"

// Named, so that the executable can be built as one unity translation unit.
namespace buckets_tests {

namespace {

struct Param {
  std::vector<float> value, grad;
};

// Seven parameters: with small buckets, packed buckets of several gradients, and two large
// enough to be communicated in place (a bucket of their own).
struct Net {
  std::vector<Param> params;
  Net() {
    for (std::size_t n : {37u, 1001u, 3u, 129u, 1u, 5002u, 64u})
      params.push_back({std::vector<float>(n, 0.25f), std::vector<float>(n)});
  }
  std::vector<Param>& parameters() { return params; }
};
constexpr ddp::BucketOptions small{
    .bucket_bytes = 512, .first_bucket_bytes = 128, .in_place_bytes = 1024};

// Rank r's gradient of parameter i, element k, at step s: not exact in float, so that the order
// and the kind of the reduction show in the bits.
float grad_of(int r, int s, std::size_t i, std::size_t k) {
  return std::sin(0.37f * static_cast<float>(k) + static_cast<float>(i) +
                  3.0f * static_cast<float>(s)) *
         (1.0f + 0.3f * static_cast<float>(r));
}
void fill(Net& m, int rank, int step) {
  for (std::size_t i = 0; i < m.params.size(); ++i)
    for (std::size_t k = 0; k < m.params[i].grad.size(); ++k)
      m.params[i].grad[k] = grad_of(rank, step, i, k);
}
std::string grads_of(const Net& m) {
  std::string s;
  for (const auto& p : m.params)
    s.append(reinterpret_cast<const char*>(p.grad.data()), p.grad.size() * sizeof(float));
  return s;
}
// Backward's order: the last parameters' gradients first.
template <class Avg>
void mark_all(Avg& avg, const Net& m) {
  for (std::size_t i = m.params.size(); i-- > 0;) avg.mark_ready(i);
}

}  // namespace

TEST_CASE("buckets: a user's hook equals the default, and sees every bucket in order") {
  mp::each_world(
      [](mp::Comm& comm) {
        Net ref, net, scaled;
        ddp::GradientAverager plain(comm, ref, small);
        ddp::GradientAverager counted(comm, net, small);
        ddp::GradientAverager summed(comm, scaled, small);
        const auto layout = counted.buckets();
        MP_EXPECT(layout.size() >= 4, layout.size() << " buckets");
        // A hook that records what it sees, then does what the default does.
        std::vector<std::size_t> seen;
        std::size_t unused = net.params.size();  // a parameter not marked: zeros in its bucket
        counted.register_comm_hook([&](mp::Comm& c, ddp::GradBucket<float>& b) {
          MP_EXPECT(b.index == seen.size(), "bucket " << b.index << " after " << seen.size());
          MP_EXPECT(b.last == (b.index + 1 == layout.size()), "last at " << b.index);
          MP_EXPECT(b.op == ddp::ReduceOp::avg && !b.shadow, "op or shadow at " << b.index);
          MP_EXPECT(b.output.data == b.buffer.data && b.output.size == b.buffer.size, "output");
          std::size_t elements = 0;
          MP_EXPECT(b.pieces.size() == layout[b.index].size(), "pieces of " << b.index);
          for (std::size_t k = 0; k < b.pieces.size(); ++k) {
            const ddp::BucketPiece& p = b.pieces[k];
            MP_EXPECT(p.param == layout[b.index][k] && p.at == elements && p.offset == 0, k);
            const auto g = b.gradient(k);
            MP_EXPECT(g.size == net.params[p.param].grad.size(), "piece " << k);
            // The buffer holds this rank's gradient, packed (or is the gradient, in place).
            const float last = p.param == unused ? 0.0f : net.params[p.param].grad.back();
            MP_EXPECT(g[g.size - 1] == last, "packed " << p.param);
            elements += p.size;
          }
          MP_EXPECT(b.buffer.size == elements, b.buffer.size << " != " << elements);
          if (b.pieces.size() == 1 && b.buffer.size * sizeof(float) >= 1024)
            MP_EXPECT(b.buffer.data == net.params[b.pieces[0].param].grad.data(), "in place");
          seen.push_back(b.index);
          return ddp::allreduce_hook(c, b);
        });
        // torch's allreduce_hook spelled out: a sum, then divided by the world size.
        int sums = 0;
        summed.register_comm_hook([&](auto& c, auto& b) {
          ++sums;
          c.all_reduce(b.buffer, ddp::ReduceOp::sum);
          for (float& x : b.buffer) x /= static_cast<float>(c.size());
          return ddp::Work{};
        });
        for (int step = 0; step < 3; ++step) {
          seen.clear();
          fill(ref, comm.rank(), step);
          fill(net, comm.rank(), step);
          fill(scaled, comm.rank(), step);
          plain.average();
          mark_all(counted, net);  // buckets start as their gradients are marked
          MP_EXPECT(seen.size() == layout.size(), seen.size() << " hooks before synchronize()");
          counted.synchronize();
          summed.average();
          MP_EXPECT(grads_of(net) == grads_of(ref), "the counting hook differs at step " << step);
          for (std::size_t i = 0; i < ref.params.size(); ++i)
            for (std::size_t k = 0; k < ref.params[i].grad.size(); ++k) {
              const float a = scaled.params[i].grad[k], b = ref.params[i].grad[k];
              MP_EXPECT(std::abs(a - b) <= 1e-6f * std::max(1.0f, std::abs(b)),
                        i << "[" << k << "]: " << a << " vs " << b);
            }
        }
        MP_EXPECT(sums == 3 * static_cast<int>(layout.size()), sums << " calls");
        // Unused parameters still count as zero: the hook sees zeros for them.
        fill(net, comm.rank(), 9);
        seen.clear();
        unused = 3;
        for (std::size_t i = 0; i < net.params.size(); ++i)
          if (i != 3) counted.mark_ready(i);
        counted.synchronize();
        for (float g : net.params[3].grad) MP_EXPECT(g == 0.0f, "unused parameter: " << g);
        // Registering while a step's buckets run is refused; between steps it is fine.
        seen.clear();
        counted.mark_ready(6);
        counted.mark_ready(5);
        mp::expect_refused(comm, "a hook mid-step", "register it between steps",
                           [&] { counted.register_comm_hook(ddp::allreduce_hook); });
        unused = net.params.size();
        mark_all(counted, net);
        counted.synchronize();
      },
      {1, 2, 3});
}

TEST_CASE("buckets: the built-in compression hooks equal BucketOptions::compression") {
  for (const auto c : {ddp::Compression::float16, ddp::Compression::bfloat16}) {
    mp::run(3, ddp::HostTransport::shm, [c](mp::Comm& comm) {
      Net a, b, exact;
      ddp::GradientAverager by_option(comm, a, {.bucket_bytes = 512, .compression = c});
      ddp::GradientAverager by_hook(comm, b, {.bucket_bytes = 512});
      ddp::GradientAverager plain(comm, exact, {.bucket_bytes = 512});
      by_hook.register_comm_hook(c == ddp::Compression::float16 ? ddp::fp16_compress_hook
                                                                : ddp::bf16_compress_hook);
      fill(a, comm.rank(), 1);
      fill(b, comm.rank(), 1);
      fill(exact, comm.rank(), 1);
      by_option.average();
      by_hook.average();
      plain.average();
      MP_EXPECT(grads_of(a) == grads_of(b), "the hook and the option differ");
      MP_EXPECT(grads_of(a) != grads_of(exact), "nothing was rounded: no compression");
      const double ulp =
          c == ddp::Compression::float16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
      for (std::size_t i = 0; i < a.params.size(); ++i)
        for (std::size_t k = 0; k < a.params[i].grad.size(); ++k) {
          const double x = a.params[i].grad[k], want = exact.params[i].grad[k];
          MP_EXPECT(std::abs(x - want) <= 4 * ulp * std::max(1.0, std::abs(want)),
                    i << "[" << k << "]: " << x << " vs " << want);
        }
      // A wire type that is not one: refused, naming it, from synchronize().
      by_hook.register_comm_hook(ddp::compress_hook(ddp::DType::int8));
      mp::expect_refused(comm, "an int8 wire", "the wire type is int8", [&] { by_hook.average(); });
    });
  }
}

TEST_CASE(
    "buckets: a hook in a ddp::Join: sums divided by the ranks that trained, zeros shadowed") {
  mp::each_world(
      [](mp::Comm& comm) {
        const int me = comm.rank(), p = comm.size();
        const auto steps_of = [](int r) {
          return std::array<int, 4>{5, 2, 4, 3}[static_cast<std::size_t>(r)];
        };
        Net net;
        ddp::GradientAverager avg(comm, net, small);
        int calls = 0, shadows = 0;
        bool joined = false;
        avg.register_comm_hook([&](auto& c, auto& b) {
          ++calls;
          MP_EXPECT(b.op == (joined ? ddp::ReduceOp::sum : ddp::ReduceOp::avg),
                    "op " << static_cast<int>(b.op) << (joined ? " in" : " out of") << " a Join");
          if (b.shadow) {
            ++shadows;
            for (float x : b.buffer) MP_EXPECT(x == 0.0f, "a shadow bucket holds " << x);
          }
          return c.all_reduce_async(b.buffer, b.op);
        });
        {
          ddp::Join join(comm, {&avg});
          joined = true;
          for (int s = 0; s < steps_of(me); ++s) {
            const int active = join.step();
            fill(net, me, s);
            avg.average();
            for (std::size_t i = 0; i < net.params.size(); ++i)
              for (std::size_t k = 0; k < net.params[i].grad.size(); k += 7) {
                float sum = 0;
                bool first = true;
                for (int r = 0; r < p; ++r) {
                  if (steps_of(r) <= s) continue;
                  sum = first ? grad_of(r, s, i, k) : sum + grad_of(r, s, i, k);
                  first = false;
                }
                const float want = sum / static_cast<float>(active);
                MP_EXPECT(std::abs(net.params[i].grad[k] - want) <= 1e-5f,
                          "step " << s << " " << i << "[" << k << "]: " << net.params[i].grad[k]
                                  << " vs " << want);
              }
          }
          join.finish();
          int longest = 0;
          for (int r = 0; r < p; ++r) longest = std::max(longest, steps_of(r));
          const auto buckets = static_cast<int>(avg.buckets().size());
          MP_EXPECT(shadows == (longest - steps_of(me)) * buckets, shadows << " shadow calls");
          MP_EXPECT(calls == longest * buckets, calls << " calls");
        }
        // Out of the Join: averages again.
        joined = false;
        calls = 0;
        fill(net, me, 0);
        avg.average();
        MP_EXPECT(calls == static_cast<int>(avg.buckets().size()), calls);
      },
      {1, 2, 4});
}

TEST_CASE(
    "buckets: a hook that throws fails synchronize(), naming the bucket, and the next step works") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    Net net, ref;
    ddp::GradientAverager avg(comm, net, small);
    ddp::GradientAverager plain(comm, ref, small);
    const auto layout = avg.buckets();
    int started = 0;
    avg.register_comm_hook([&](auto& c, auto& b) {
      if (b.index == 2) throw std::runtime_error("no wire today");
      ++started;
      return ddp::allreduce_hook(c, b);
    });
    fill(net, comm.rank(), 0);
    mark_all(avg, net);  // the throw is kept: not out of mark_ready (backward's hooks)
    std::string params;
    for (std::size_t i : layout[2]) params += (params.empty() ? "" : ", ") + std::to_string(i);
    mp::expect_refused(
        comm, "a throwing hook",
        "the comm hook failed on bucket 2 (parameters " + params + "): no wire today",
        [&] { avg.synchronize(); });
    MP_EXPECT(started == 2, started << " buckets started: none after the failed one");
    // A ddp::Error of the hook keeps its code.
    avg.register_comm_hook([](auto&, auto& b) -> ddp::Work {
      if (b.last) throw ddp::Error(ddp::Errc::unsupported, "not here");
      return {};
    });
    try {
      avg.average();
      MP_EXPECT(false, "no error");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::unsupported, e.what());
      MP_EXPECT(std::string(e.what()).find("bucket " + std::to_string(layout.size() - 1)) !=
                    std::string::npos,
                e.what());
    }
    // The step was dropped: the next one, with a working hook, is as the default.
    avg.register_comm_hook(ddp::allreduce_hook);
    fill(net, comm.rank(), 1);
    fill(ref, comm.rank(), 1);
    avg.average();
    plain.average();
    MP_EXPECT(grads_of(net) == grads_of(ref), "the step after a failure differs");
  });
}

TEST_CASE("buckets: ShardedAverager with its own hook equals reduce_scatter_hook") {
  mp::each_world(
      [](mp::Comm& comm) {
        Net a, b;
        ddp::ShardedAverager zero(comm, a, small);
        ddp::ShardedAverager mine(comm, b, small);
        int calls = 0;
        // An all_reduce leaves every block averaged, this rank's among them.
        mine.register_comm_hook([&](mp::Comm& c, ddp::GradBucket<float>& bucket) {
          ++calls;
          MP_EXPECT(bucket.output.size * static_cast<std::size_t>(c.size()) == bucket.buffer.size,
                    "this rank's block");
          MP_EXPECT(bucket.output.data == bucket.buffer.data + static_cast<std::size_t>(c.rank()) *
                                                                   bucket.output.size,
                    "block " << c.rank());
          return c.all_reduce_async(bucket.buffer, bucket.op);
        });
        for (int step = 0; step < 2; ++step) {
          fill(a, comm.rank(), step);
          fill(b, comm.rank(), step);
          zero.step([](auto shard) {
            for (auto& s : shard)
              for (std::size_t k = 0; k < s.value.size; ++k) s.value.data[k] -= s.grad.data[k];
          });
          mine.step([](auto shard) {
            for (auto& s : shard)
              for (std::size_t k = 0; k < s.value.size; ++k) s.value.data[k] -= s.grad.data[k];
          });
        }
        MP_EXPECT(calls == 2 * static_cast<int>(mine.buckets().size()), calls << " calls");
        for (std::size_t i = 0; i < a.params.size(); ++i)
          for (std::size_t k = 0; k < a.params[i].value.size(); ++k) {
            const float x = b.params[i].value[k], want = a.params[i].value[k];
            MP_EXPECT(std::abs(x - want) <= 1e-6f * std::max(1.0f, std::abs(want)),
                      i << "[" << k << "]: " << x << " vs " << want);
          }
        // Compression is GradientAverager's only.
        mp::expect_refused(comm, "a compressed ShardedAverager", "compression applies to", [&] {
          ddp::ShardedAverager bad(comm, a, {.compression = ddp::Compression::bfloat16});
        });
      },
      {1, 2, 3, 4});
}

}  // namespace buckets_tests
