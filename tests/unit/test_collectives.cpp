// Every collective x dtype x op x world size 1..4 x counts 0, 1, odd and larger than a segment,
// over both transports, against references computed here, in real forked processes.
#include "multiprocess.hpp"

#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>

namespace {

using ddp::ReduceOp;
using mp::Comm;

template <class F>
void for_each_dtype(F&& f) {
  f.template operator()<std::int8_t>();
  f.template operator()<std::uint8_t>();
  f.template operator()<std::int32_t>();
  f.template operator()<std::uint32_t>();
  f.template operator()<std::int64_t>();
  f.template operator()<std::uint64_t>();
  f.template operator()<ddp::half>();
  f.template operator()<ddp::bfloat16>();
  f.template operator()<float>();
  f.template operator()<double>();
}

constexpr ReduceOp all_ops[] = {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max,
                                ReduceOp::avg};

/// Rank r's i-th input: small integers for integer types; values whose sums round, for floats,
/// so that the order of summation shows in the bits.
template <class T>
T value(int rank, std::size_t i, int salt = 0) {
  const auto k = static_cast<std::size_t>(rank * 37 + salt * 13) + i * 11;
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<int>(k % 5) + 1 -
                          (std::is_signed_v<T> && (k % 3 == 0) ? 3 : 0));
  } else {
    return T(static_cast<float>(k % 97) * 0.0625f + 0.01f * static_cast<float>(rank + 1) + 0.3f);
  }
}

/// The documented semantics: combine in rank order 0..P-1; half and bfloat16 in float, rounded
/// once; integers wrap; avg divides by P. Written independently of the library's kernels.
template <class T>
T reference(ReduceOp op, int p, std::size_t i, int salt = 0) {
  using A = std::conditional_t<std::is_same_v<T, ddp::half> || std::is_same_v<T, ddp::bfloat16>,
                               float, T>;
  auto acc = static_cast<A>(value<T>(0, i, salt));
  for (int r = 1; r < p; ++r) {
    const auto x = static_cast<A>(value<T>(r, i, salt));
    if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      switch (op) {
        case ReduceOp::sum:
          acc = static_cast<A>(static_cast<U>(static_cast<U>(acc) + static_cast<U>(x)));
          break;
        case ReduceOp::prod:
          acc = static_cast<A>(static_cast<U>(static_cast<std::uint64_t>(static_cast<U>(acc)) *
                                              static_cast<std::uint64_t>(static_cast<U>(x))));
          break;
        case ReduceOp::min: acc = std::min(acc, x); break;
        case ReduceOp::max: acc = std::max(acc, x); break;
        case ReduceOp::avg: break;
      }
    } else {
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: acc = acc + x; break;
        case ReduceOp::prod: acc = acc * x; break;
        case ReduceOp::min: acc = x < acc ? x : acc; break;
        case ReduceOp::max: acc = acc < x ? x : acc; break;
      }
    }
  }
  if constexpr (!std::is_integral_v<A>) {
    if (op == ReduceOp::avg) acc = acc / static_cast<A>(p);
  }
  return static_cast<T>(acc);
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
std::string show(const T& v) {
  if constexpr (std::is_integral_v<T>)
    return std::to_string(static_cast<long long>(v));
  else
    return std::to_string(static_cast<double>(static_cast<float>(v)));
}

/// Counts to test for element type T: empty, one, odd, and more than three segments.
template <class T>
std::vector<std::size_t> counts() {
  return {0, 1, 7, 3 * mp::test_segment / sizeof(T) + 5};
}

template <class T>
void check_values(const std::vector<T>& got, const std::function<T(std::size_t)>& want,
                  const std::string& what) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    const T w = want(i);
    MP_EXPECT(same_bits(got[i], w),
              what << ": element " << i << " is " << show(got[i]) << ", expected " << show(w));
  }
}

}  // namespace

TEST_CASE("all_reduce: every dtype, op and count, sync and async") {
  mp::each_world([](Comm& comm) {
    const int p = comm.size(), r = comm.rank();
    for_each_dtype([&]<class T>() {
      for (ReduceOp op : all_ops) {
        if (!ddp::is_supported(op, ddp::dtype_of<T>)) continue;
        for (std::size_t n : counts<T>()) {
          std::vector<T> buf(n);
          for (std::size_t i = 0; i < n; ++i) buf[i] = value<T>(r, i);
          const std::string what = "all_reduce(" + std::string(ddp::to_string(ddp::dtype_of<T>)) +
                                   ", " + std::string(ddp::to_string(op)) +
                                   ", n=" + std::to_string(n) + ")";
          if (n % 2 == 0)
            comm.all_reduce(buf, op);
          else
            comm.all_reduce_async(buf, op).wait();
          check_values<T>(
              buf, [&](std::size_t i) { return reference<T>(op, p, i); }, what);
        }
      }
    });
  });
}

TEST_CASE("avg is refused on integer types before anything is sent") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    std::vector<int> v(3);
    try {
      comm.all_reduce(v, ReduceOp::avg);
      MP_EXPECT(false, "avg on int32 was accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
      MP_EXPECT(std::string(e.what()).find("avg needs a floating-point type") != std::string::npos,
                e.what());
    }
    comm.all_reduce(v);  // the communicator is still usable
  });
}

TEST_CASE("reduce: the root gets the reduction, the others keep their buffers") {
  mp::each_world([](Comm& comm) {
    const int p = comm.size(), r = comm.rank();
    for_each_dtype([&]<class T>() {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
        for (int root : {0, p - 1}) {
          for (std::size_t n : counts<T>()) {
            std::vector<T> buf(n);
            for (std::size_t i = 0; i < n; ++i) buf[i] = value<T>(r, i, 1);
            comm.reduce(buf, root, op);
            const std::string what =
                "reduce(root " + std::to_string(root) + ", n=" + std::to_string(n) + ")";
            if (r == root)
              check_values<T>(
                  buf, [&](std::size_t i) { return reference<T>(op, p, i, 1); }, what);
            else
              check_values<T>(
                  buf, [&](std::size_t i) { return value<T>(r, i, 1); }, what + " non-root");
          }
        }
      }
    });
  });
}

TEST_CASE("broadcast: every dtype, count and root") {
  mp::each_world([](Comm& comm) {
    const int p = comm.size(), r = comm.rank();
    for_each_dtype([&]<class T>() {
      for (int root = 0; root < p; ++root) {
        for (std::size_t n : counts<T>()) {
          std::vector<T> buf(n);
          for (std::size_t i = 0; i < n; ++i) buf[i] = value<T>(r, i);
          if (root % 2 == 0)
            comm.broadcast(buf, root);
          else
            comm.broadcast_async(buf, root).wait();
          check_values<T>(
              buf, [&](std::size_t i) { return value<T>(root, i); },
              "broadcast(root " + std::to_string(root) + ")");
        }
      }
    });
  });
}

TEST_CASE("all_gather and gather, including in place") {
  mp::each_world([](Comm& comm) {
    const int p = comm.size(), r = comm.rank();
    const auto up = static_cast<std::size_t>(p);
    for_each_dtype([&]<class T>() {
      for (std::size_t n : counts<T>()) {
        std::vector<T> in(n);
        for (std::size_t i = 0; i < n; ++i) in[i] = value<T>(r, i);
        const auto want = [&](std::size_t k) {
          return value<T>(static_cast<int>(k / std::max<std::size_t>(n, 1)),
                          k % std::max<std::size_t>(n, 1));
        };
        std::vector<T> out(n * up);
        comm.all_gather(in, out);
        check_values<T>(out, want, "all_gather(n=" + std::to_string(n) + ")");
        // In place: this rank's block of `out` is the input.
        std::vector<T> inplace(n * up);
        std::copy(in.begin(), in.end(),
                  inplace.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(r)));
        comm.all_gather(std::span<T>(inplace).subspan(n * static_cast<std::size_t>(r), n), inplace);
        check_values<T>(inplace, want, "all_gather in place");
        for (int root : {0, p - 1}) {
          std::vector<T> g(r == root ? n * up : 0);
          comm.gather(in, g, root);
          if (r == root) check_values<T>(g, want, "gather(root " + std::to_string(root) + ")");
        }
      }
    });
  });
}

TEST_CASE("scatter, reduce_scatter and all_to_all") {
  mp::each_world([](Comm& comm) {
    const int p = comm.size(), r = comm.rank();
    const auto up = static_cast<std::size_t>(p);
    for_each_dtype([&]<class T>() {
      for (std::size_t n :
           {std::size_t{0}, std::size_t{1}, std::size_t{5}, mp::test_segment / sizeof(T) + 3}) {
        const std::string tag = "(n=" + std::to_string(n) + ")";
        // scatter: block j of root's input goes to rank j.
        for (int root : {0, p - 1}) {
          std::vector<T> in(r == root ? n * up : 0);
          for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<T>(root, k, 2);
          std::vector<T> out(n);
          comm.scatter(in, out, root);
          check_values<T>(
              out,
              [&](std::size_t i) { return value<T>(root, static_cast<std::size_t>(r) * n + i, 2); },
              "scatter" + tag);
        }
        // reduce_scatter: block r of the element-wise reduction.
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::min}) {
          std::vector<T> in(n * up);
          for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<T>(r, k, 3);
          std::vector<T> out(n);
          comm.reduce_scatter(in, out, op);
          check_values<T>(
              out,
              [&](std::size_t i) {
                return reference<T>(op, p, static_cast<std::size_t>(r) * n + i, 3);
              },
              "reduce_scatter" + tag);
          // In place: out is this rank's block of in.
          for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<T>(r, k, 3);
          auto mine = std::span<T>(in).subspan(static_cast<std::size_t>(r) * n, n);
          comm.reduce_scatter(in, mine, op);
          std::vector<T> copy(mine.begin(), mine.end());
          check_values<T>(
              copy,
              [&](std::size_t i) {
                return reference<T>(op, p, static_cast<std::size_t>(r) * n + i, 3);
              },
              "reduce_scatter in place" + tag);
        }
        // all_to_all: out block j = rank j's in block r.
        std::vector<T> in(n * up), out(n * up);
        for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<T>(r, k, 4);
        comm.all_to_all(in, out);
        check_values<T>(
            out,
            [&](std::size_t k) {
              const auto j = static_cast<int>(k / std::max<std::size_t>(n, 1));
              return value<T>(j, static_cast<std::size_t>(r) * n + k % std::max<std::size_t>(n, 1),
                              4);
            },
            "all_to_all" + tag);
      }
    });
  });
}

TEST_CASE("send and recv around a ring, and barrier") {
  mp::each_world(
      [](Comm& comm) {
        const int p = comm.size(), r = comm.rank();
        for (std::size_t n :
             {std::size_t{1}, std::size_t{1000}, std::size_t{300000}}) {  // > a channel
          std::vector<double> out(n), in(n);
          for (std::size_t i = 0; i < n; ++i) out[i] = r * 1e6 + static_cast<double>(i);
          const int next = (r + 1) % p, prev = (r + p - 1) % p;
          // Even ranks send first, odd ranks receive first: no cycle of blocked senders.
          if (r % 2 == 0) {
            comm.send(out, next, 7);
            comm.recv(in, prev, 7);
          } else {
            comm.recv(in, prev, 7);
            comm.send(out, next, 7);
          }
          for (std::size_t i = 0; i < n; ++i)
            MP_EXPECT(in[i] == prev * 1e6 + static_cast<double>(i), "ring element " << i);
          comm.barrier();
        }
        auto w = comm.barrier_async();
        w.wait();
        MP_EXPECT(w.test() && !w.failed(), "barrier_async");
      },
      {2, 3, 4});
}

TEST_CASE("async operations complete in issue order, interleaved with sync ones") {
  mp::each_world([](Comm& comm) {
    const int p = comm.size();
    std::vector<std::vector<float>> bufs(6, std::vector<float>(20000));
    std::vector<ddp::Work> works;
    for (std::size_t k = 0; k < bufs.size(); ++k) {
      std::fill(bufs[k].begin(), bufs[k].end(),
                static_cast<float>(comm.rank() + static_cast<int>(k)));
      works.push_back(comm.all_reduce_async(bufs[k]));
    }
    std::vector<int> sync{comm.rank()};
    comm.all_reduce(sync);  // waits for the queued ones, then runs
    for (auto& w : works) w.wait();
    for (std::size_t k = 0; k < bufs.size(); ++k) {
      const float want = static_cast<float>(p * (p - 1) / 2 + p * static_cast<int>(k));
      MP_EXPECT(bufs[k][0] == want && bufs[k].back() == want,
                "async all_reduce " << k << " gave " << bufs[k][0]);
    }
    MP_EXPECT(sync[0] == p * (p - 1) / 2, "sync all_reduce after async ones");
  });
}

TEST_CASE("split: groups by color, ordered by key") {
  mp::each_world(
      [](Comm& comm) {
        const int r = comm.rank(), p = comm.size();
        // Two groups by parity, ordered by descending world rank.
        auto sub = comm.split(r % 2, -r);
        const int members = (p + 1 - r % 2) / 2;
        MP_EXPECT(sub.valid() && sub.size() == members, "split size " << sub.size());
        std::vector<int> v{r};
        sub.all_reduce(v);
        int want = 0;
        for (int k = r % 2; k < p; k += 2) want += k;
        MP_EXPECT(v[0] == want, "sum within the group: " << v[0] << " != " << want);
        auto ranks = sub.all_gather_object(r);
        for (std::size_t i = 1; i < ranks.size(); ++i)
          MP_EXPECT(ranks[i - 1] > ranks[i], "key order");
        MP_EXPECT(ranks[static_cast<std::size_t>(sub.rank())] == r, "own slot");
        // A rank can stay out, and the others still form a group.
        auto partial = comm.split(r == 0 ? Comm::no_color : 1);
        MP_EXPECT(partial.valid() == (r != 0), "no_color");
        if (partial.valid()) {
          MP_EXPECT(partial.size() == p - 1, "partial size");
          partial.barrier();
        }
        MP_EXPECT(comm.local_group().size() == p, "local group on one host");
        comm.barrier();  // the parent still works
      },
      {1, 2, 3, 4});
}

TEST_CASE("object collectives") {
  mp::each_world([](Comm& comm) {
    const int r = comm.rank(), p = comm.size();
    struct Stats {
      int rank;
      double loss;
    };
    const auto all = comm.all_gather_object(Stats{r, r * 0.5});
    MP_EXPECT(static_cast<int>(all.size()) == p, "all_gather_object size");
    for (int k = 0; k < p; ++k)
      MP_EXPECT(all[static_cast<std::size_t>(k)].rank == k &&
                    all[static_cast<std::size_t>(k)].loss == k * 0.5,
                "entry " << k);
    const std::vector<std::string> words(
        static_cast<std::size_t>(r + 1),
        std::string(static_cast<std::size_t>(r) * 1000, 'a' + static_cast<char>(r)));
    const auto gathered = comm.gather_object(words, p - 1);
    if (r == p - 1) {
      MP_EXPECT(static_cast<int>(gathered.size()) == p, "gather_object size");
      for (int k = 0; k < p; ++k) {
        MP_EXPECT(gathered[static_cast<std::size_t>(k)].size() == static_cast<std::size_t>(k + 1),
                  "rank " << k << " words");
      }
    } else {
      MP_EXPECT(gathered.empty(), "non-root gets nothing");
    }
    std::pair<std::string, std::vector<int>> config;
    if (r == 0) config = {"lr=0.1", {1, 2, 3}};
    comm.broadcast_object(config, 0);
    MP_EXPECT(config.first == "lr=0.1" && config.second == std::vector<int>({1, 2, 3}),
              "broadcast_object");
  });
}

TEST_CASE("argument checks fail before anything is sent, naming the rank and the collective") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    const auto expect_invalid = [&](const std::function<void()>& f, const std::string& needle) {
      try {
        f();
      } catch (const ddp::Error& e) {
        MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
        MP_EXPECT(std::string(e.what()).find(needle) != std::string::npos,
                  "'" << e.what() << "' lacks '" << needle << "'");
        MP_EXPECT(std::string(e.what()).find("rank " + std::to_string(comm.rank())) == 0, e.what());
        return;
      }
      MP_EXPECT(false, "accepted: " << needle);
    };
    std::vector<float> a(4), b(7), c(8);
    std::vector<int> ints(8);
    expect_invalid([&] { comm.broadcast(a, 2); }, "broadcast: root 2 is not a rank");
    expect_invalid([&] { comm.reduce(a, -1); }, "reduce: root -1");
    expect_invalid([&] { comm.all_gather(a, b); },
                   "all_gather: `out` has 7 elements but must have 4 x 2 = 8");
    expect_invalid([&] { comm.all_gather(a, ints); }, "`in` is float32 but `out` is int32");
    expect_invalid([&] { comm.reduce_scatter(b, a); },
                   "reduce_scatter: `in` has 7 elements but must have 4 x 2 = 8");
    expect_invalid([&] { comm.all_to_all(b, b); }, "all_to_all");
    expect_invalid([&] { comm.all_to_all(c, c); }, "must not overlap");
    expect_invalid([&] { comm.all_gather(std::span<float>(c).subspan(1, 4), c); },
                   "not this rank's block");
    expect_invalid([&] { comm.send(a, comm.rank()); }, "send: peer");
    expect_invalid([&] { comm.recv(a, 5); }, "recv: peer 5");
    expect_invalid([&] { comm.send(a, 1 - comm.rank(), -3); }, "tag -3");
    expect_invalid([&] { comm.all_reduce(ints, static_cast<ddp::ReduceOp>(42)); }, "op invalid");
    ddp::TensorView<float> nowhere{nullptr, 3};
    expect_invalid([&] { comm.all_reduce(nowhere); }, "has 3 elements but no data");
    ddp::TensorView<float> gpu{a.data(), a.size(), ddp::Device::cuda(0)};
    expect_invalid([&] { comm.all_reduce(gpu); },
                   "is on cuda:0, but backend::host cannot use that memory");
    comm.all_reduce(a);  // nothing was sent: the communicator still works
  });
}

TEST_CASE("DDP_HOST_TRANSPORT picks the transport; a bad value is refused") {
  for (const std::string t : {"tcp", "shm"}) {
    ddp::SpawnOptions so;
    so.env = {"DDP_HOST_TRANSPORT=" + t};
    try {
      ddp::spawn(
          2,
          [&](ddp::Environment env) {
            auto comm = Comm::init(env);
            MP_EXPECT(comm.backend().transport() == t, "transport " << comm.backend().transport());
            std::vector<int> v{1};
            comm.all_reduce(v);
            MP_EXPECT(v[0] == 2, "sum");
          },
          so);
    } catch (const ddp::Error& e) {
      FAIL_CHECK(t << ": " << std::string(e.what()));
    }
  }
  ddp::SpawnOptions so;
  so.env = {"DDP_HOST_TRANSPORT=carrier-pigeon"};
  try {
    ddp::spawn(
        2, [](ddp::Environment env) { auto comm = Comm::init(env); }, so);
    FAIL("a bad DDP_HOST_TRANSPORT was accepted");
  } catch (const ddp::Error& e) {
    CHECK(std::string(e.what()).find(
              "DDP_HOST_TRANSPORT=\"carrier-pigeon\": use shm, tcp or auto") != std::string::npos);
  }
}
