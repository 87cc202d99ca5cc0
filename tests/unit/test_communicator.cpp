// Every collective x dtype x op x world size 1..4 x counts 0, 1, odd and larger than a segment,
// over both transports, against references computed here, in real forked processes.
#include "collective_cases.hpp"

#include <algorithm>
#include <array>
#include <cstdint>
#include <exception>
#include <span>
#include <thread>
#include <vector>

namespace {
using ddp::ReduceOp;
using mp::Comm;
}  // namespace

TEST_CASE("all_reduce: every dtype, op and count, sync and async") {
  mp::each_world([](Comm& comm) { cases::all_reduce_every_dtype(comm); });
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

TEST_CASE("premul_sum in every reducing collective, bitwise ops refused on floating point") {
  mp::each_world([](Comm& comm) { cases::premul_sum_every_form(comm); });
}

TEST_CASE("bool and the bitwise ops: values stay 0 or 1, band/bor/bxor refused on floats") {
  // all_reduce_every_dtype covers bool and band/bor/bxor on every path; this checks what a
  // torch user relies on: a flag any rank raised (sum/bor) or every rank raised (band/min).
  mp::each_world([](Comm& comm) {
    const bool mine = comm.rank() == comm.size() - 1;
    std::array<bool, 3> any{mine, false, true}, all{mine, false, true}, odd{true, mine, false};
    comm.all_reduce(any, ReduceOp::sum);
    comm.all_reduce(all, ReduceOp::band);
    comm.all_reduce(odd, ReduceOp::bxor);
    const bool one = comm.size() == 1;
    MP_EXPECT(any[0] && !any[1] && any[2], "bool sum");
    MP_EXPECT(all[0] == one && !all[1] && all[2], "bool band");
    MP_EXPECT(odd[0] == (comm.size() % 2 == 1) && odd[1] && !odd[2], "bool bxor");
    std::array<std::uint8_t, 3> bytes{};
    std::memcpy(bytes.data(), any.data(), 3);
    MP_EXPECT(bytes[0] == 1 && bytes[1] == 0 && bytes[2] == 1, "bool bytes stay 0 or 1");
    static_assert(!ddp::TensorLike<std::vector<bool>>);  // not contiguous: not a tensor
    std::array<bool, 1> avg{true};
    mp::expect_refused(comm, "avg on bool", "avg needs a floating-point type",
                       [&] { comm.all_reduce(avg, ReduceOp::avg); });
    mp::expect_refused(comm, "premul_sum on bool", "op premul_sum is not defined on bool",
                       [&] { comm.all_reduce(avg, ddp::premul_sum(2)); });
    comm.all_reduce(avg, ReduceOp::max);  // still usable
  });
}

TEST_CASE("named roles: ddp::from(in), ddp::into(out) in every buffer-pair collective") {
  mp::each_world([](Comm& comm) { cases::named_roles(comm); }, {1, 3});
}

TEST_CASE("reduce: the root gets the reduction, the others keep their buffers") {
  mp::each_world([](Comm& comm) { cases::reduce_to_root(comm); });
}

TEST_CASE("broadcast: every dtype, count and root") {
  mp::each_world([](Comm& comm) { cases::broadcast_every_root(comm); });
}

TEST_CASE("all_gather and gather, including in place") {
  mp::each_world([](Comm& comm) { cases::all_gather_and_gather(comm); });
}

TEST_CASE("scatter, reduce_scatter and all_to_all") {
  mp::each_world([](Comm& comm) { cases::scatter_reduce_scatter_all_to_all(comm); });
}

TEST_CASE("uneven sizes: all_to_all with split sizes, all_gather, gather and scatter with counts") {
  mp::each_world([](Comm& comm) { cases::uneven_collectives(comm); });
}

namespace {
/// A backend with the required members only (backend.hpp's CommBackend), over backend::Host:
/// what a third-party backend gets for the optional capabilities it lacks (the uneven
/// collectives by send/recv pairs, split over the store).
struct MinimalBackend {
  using Buf = ddp::detail::Buf;
  static constexpr std::string_view name = "minimal";
  std::unique_ptr<ddp::backend::Host> h;
  static std::unique_ptr<MinimalBackend> create(const ddp::detail::BackendInit& init) {
    auto m = std::make_unique<MinimalBackend>();
    m->h = ddp::backend::Host::create(init);
    return m;
  }
  static bool supports(const ddp::Device& d) { return ddp::backend::Host::supports(d); }
  [[nodiscard]] int rank() const { return h->rank(); }
  [[nodiscard]] int size() const { return h->size(); }
  [[nodiscard]] int local_rank() const { return h->local_rank(); }
  [[nodiscard]] int local_size() const { return h->local_size(); }
  [[nodiscard]] int local_leader() const { return h->local_leader(); }
  void all_reduce(const Buf& b, ddp::ReduceOp op) { h->all_reduce(b, op); }
  void broadcast(const Buf& b, int root) { h->broadcast(b, root); }
  void reduce(const Buf& b, int root, ddp::ReduceOp op) { h->reduce(b, root, op); }
  void all_gather(const Buf& i, const Buf& o) { h->all_gather(i, o); }
  void gather(const Buf& i, const Buf& o, int root) { h->gather(i, o, root); }
  void scatter(const Buf& i, const Buf& o, int root) { h->scatter(i, o, root); }
  void reduce_scatter(const Buf& i, const Buf& o, ddp::ReduceOp op) { h->reduce_scatter(i, o, op); }
  void all_to_all(const Buf& i, const Buf& o) { h->all_to_all(i, o); }
  void send(const Buf& b, int peer, int tag) { h->send(b, peer, tag); }
  void recv(const Buf& b, int peer, int tag) { h->recv(b, peer, tag); }
  void barrier() { h->barrier(); }
  void abort(ddp::Errc code, const std::string& why) { h->abort(code, why); }
};
static_assert(ddp::CommBackend<MinimalBackend>);
static_assert(!ddp::backend_traits<MinimalBackend>::uneven);
static_assert(ddp::backend_traits<ddp::backend::Host>::uneven);
}  // namespace

TEST_CASE("a backend without its own uneven collectives runs them by send/recv pairs") {
  for (int w : {1, 3, 4}) {
    if (!mp::world_selected(w)) continue;
    CAPTURE(w);
    ddp::spawn(w, [](ddp::Environment env) {
      ddp::Options o;
      o.segment_bytes = mp::test_segment;
      auto comm = ddp::Communicator<MinimalBackend>::init(env, o);
      cases::uneven_collectives(comm);
      // Counts that disagree: the receive that expects 2 elements gets a message of 1. (After a
      // barrier: by pairs, a rank may finish a collective and fail in the next while another is
      // still in the first, which the failure then ends too.)
      comm.barrier();
      if (comm.size() > 1) {
        std::vector<std::size_t> ins(static_cast<std::size_t>(comm.size()), 1), outs = ins;
        if (comm.rank() == 1) outs[0] = 2;
        std::vector<float> in(ins.size()), out(ins.size() + (comm.rank() == 1 ? 1 : 0));
        try {
          comm.all_to_all(in, out, ins, outs);
          MP_EXPECT(comm.rank() != 1, "rank 1 expected 2 elements from rank 0 and got 1");
        } catch (const ddp::Error& e) {  // the others fail too, quoting it or at its leaving
          if (comm.rank() == 1) MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
        }
      }
    });
  }
}

TEST_CASE("batch_isend_irecv: every pair at once, beyond a channel, against plain send/recv") {
  mp::each_world([](Comm& comm) { cases::batch_p2p(comm); });
}

TEST_CASE("send and recv around a ring, and barrier") {
  mp::each_world([](Comm& comm) { cases::send_recv_ring(comm); }, {2, 3, 4});
}

TEST_CASE("async operations complete in issue order, interleaved with sync ones") {
  mp::each_world([](Comm& comm) { cases::async_in_issue_order(comm); });
}

TEST_CASE("an operation the flight recorder shows as issued runs before any issued after it") {
  // A synchronous reduce that finds the queue busy is numbered as it joins the queue: a thread
  // that waits to see its record and then issues a broadcast cannot overtake it (it did when
  // the number was taken before the operation was queued: ranks ran different orders).
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    std::vector<float> big(1 << 16, 1.0f), a(8, 1.0f), b(16, 1.0f);
    for (int i = 0; i < 1500; ++i) {
      const std::uint64_t base = i == 0 ? 0 : comm.recent().back().seq + 1;
      ddp::Work busy = comm.all_reduce_async(big);  // keeps the worker busy
      std::exception_ptr error;
      std::thread t([&] {
        try {
          comm.reduce(a, 0);
        } catch (...) {
          error = std::current_exception();
        }
      });
      while (comm.recent().back().seq < base + 1 && !error) std::this_thread::yield();
      ddp::Work after = comm.broadcast_async(b, 0);
      t.join();
      busy.wait();
      after.wait();
      if (error) std::rethrow_exception(error);
    }
  });
}

TEST_CASE("all_reduce_coalesced: several buffers as one operation, sync and async") {
  mp::each_world([](Comm& comm) { cases::all_reduce_coalesced(comm); }, {1, 3});
}

TEST_CASE("all_reduce_as: float32 carried as half or bfloat16, every op and count") {
  mp::each_world([](Comm& comm) { cases::all_reduce_compressed(comm); });
}

TEST_CASE("all_reduce_host and broadcast_host: small host values, exact_mean, ZeroFirstGuard") {
  mp::each_world([](Comm& comm) { cases::host_values(comm); }, {1, 3});
}

TEST_CASE("split: groups by color, ordered by key") {
  mp::each_world([](Comm& comm) { cases::split_by_color(comm); }, {1, 2, 3, 4});
}

TEST_CASE("object collectives") {
  mp::each_world([](Comm& comm) { cases::object_collectives(comm); });
}

TEST_CASE("object collectives of different types on the ranks fail naming the call and the rank") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    try {
      if (comm.rank() == 0)
        (void)comm.all_gather_object(std::string("text"));
      else
        (void)comm.all_gather_object(std::int64_t{7});
      MP_EXPECT(false, "objects of two types were gathered");
    } catch (const ddp::Error& e) {
      const std::string w = e.what();
      MP_EXPECT(e.code() == ddp::Errc::mismatch, w);
      MP_EXPECT(w.rfind("rank " + std::to_string(comm.rank()) + ": all_gather_object: what rank " +
                            std::to_string(1 - comm.rank()) + " sent does not decode",
                        0) == 0,
                w);
      MP_EXPECT(w.find("every rank must make the same calls") != std::string::npos, w);
    }
  });
}

TEST_CASE("run-time-typed tensors (ddp::DynamicView): every dtype through every collective") {
  // The same cases and references as above, through a tensor type that knows its dtype only at
  // run time: adapted by tensor_traits in even worlds, by a member ddp_view() in odd ones. Run
  // types change how arguments become buffers, not the path the buffers take: shared memory
  // only (the typed cases above take every path).
  mp::each_world_on({ddp::HostTransport::shm}, [](Comm& comm) {
    const auto all = [&](auto wrap) {
      cases::all_reduce_every_dtype(comm, wrap);
      cases::reduce_to_root(comm, wrap);
      cases::broadcast_every_root(comm, wrap);
      cases::all_gather_and_gather(comm, wrap);
      cases::scatter_reduce_scatter_all_to_all(comm, wrap);
      cases::uneven_collectives(comm, wrap);
      cases::batch_p2p(comm, wrap);
      cases::all_reduce_coalesced(comm, wrap);
      cases::premul_sum_every_form(comm, wrap);
      cases::named_roles(comm, wrap);
      if (comm.size() > 1) cases::send_recv_ring(comm, wrap);
      cases::async_in_issue_order(comm, wrap);
    };
    if (comm.size() % 2 == 0)
      all(cases::AsRuntime{});
    else
      all(cases::AsRuntimeMember{});
  });
}

TEST_CASE("run-time-typed tensors are checked when the collective is called") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    std::vector<float> v(8, 1.0f);
    std::vector<int> ints(8, 1);
    const auto refused = [&](const char* what, const std::string& needle, auto&& call) {
      mp::expect_refused(comm, what, needle, call);
    };
    const cases::RuntimeTensor f{v.data(), v.size(), ddp::DType::float32, false};
    const cases::RuntimeTensor i{ints.data(), ints.size(), ddp::DType::int32, false};
    cases::RuntimeTensor ro = f;
    ro.read_only = true;
    refused("avg on int32", "avg needs a floating-point type",
            [&] { comm.all_reduce(i, ReduceOp::avg); });
    refused("a read-only output", "`buf` is read-only", [&] { comm.all_reduce(ro); });
    refused("a read-only recv", "recv: `buf` is read-only",
            [&] { comm.recv(ro, 1 - comm.rank()); });
    std::vector<float> gathered(16);
    cases::RuntimeTensor out{gathered.data(), gathered.size(), ddp::DType::float32, true};
    refused("a read-only all_gather output", "all_gather: `out` is read-only",
            [&] { comm.all_gather(f, out); });
    refused("mixed dtypes", "they must have the same element type", [&] {
      comm.all_gather(i, cases::RuntimeTensor{gathered.data(), 16});
    });
    cases::RuntimeTensor bad = f;
    bad.dtype = static_cast<ddp::DType>(42);
    refused("an invalid dtype code", "dtype code 42", [&] { comm.all_reduce(bad); });
    cases::RuntimeTensor null = f;
    null.data = nullptr;
    refused("a null pointer", "has 8 elements but no data", [&] { comm.broadcast(null, 0); });
    struct Sliced {
      float* p;
      [[nodiscard]] ddp::DynamicView ddp_view() const {
        return {.data = p, .size = 4, .dtype = ddp::DType::float32, .contiguous = false};
      }
    };
    refused("a non-contiguous tensor", "`buf` is not contiguous",
            [&] { comm.all_reduce(Sliced{v.data()}); });
    struct Undefined {
      [[nodiscard]] ddp::DynamicView ddp_view() const {
        return {.problem = "an undefined tensor (it has no storage)"};
      }
    };
    refused("an adapter's problem", "`buf` cannot be used: an undefined tensor",
            [&] { comm.reduce(Undefined{}, 0); });
    // A read-only tensor is fine where the collective only reads it.
    std::vector<float> got(8);
    const cases::RuntimeTensor into{got.data(), got.size()};
    if (comm.rank() == 0) {
      comm.send(ro, 1);
      comm.recv(into, 1);
    } else {
      comm.recv(into, 0);
      comm.send(ro, 0);
    }
    MP_EXPECT(got[0] == 1.0f, got[0]);
    comm.all_reduce(f);  // the communicator is still usable after the refusals
    MP_EXPECT(v[0] == 2.0f, v[0]);
  });
}

TEST_CASE("read-only inputs: const containers and spans of const elements") {
  // Every argument a collective only reads takes a const buffer (this failed to compile: the
  // element type's const reached a cast that drops it).
  mp::each_world(
      [](Comm& comm) {
        const int p = comm.size(), r = comm.rank();
        const std::vector<float> mine{static_cast<float>(r), static_cast<float>(10 * r)};
        const std::span<const float> mine_span(mine);
        std::vector<float> all(2 * static_cast<std::size_t>(p));
        comm.all_gather(mine, all);
        for (std::size_t j = 0; j < static_cast<std::size_t>(p); ++j) {
          MP_EXPECT(all[2 * j] == static_cast<float>(j) &&
                        all[2 * j + 1] == 10.0F * static_cast<float>(j),
                    j);
        }
        std::fill(all.begin(), all.end(), -1.0F);
        comm.all_gather_async(mine_span, all).wait();
        MP_EXPECT(all.back() == 10.0F * static_cast<float>(p - 1), all.back());
        std::vector<float> gathered(r == 0 ? all.size() : 0);
        comm.gather(mine, gathered, 0);
        if (r == 0) MP_EXPECT(gathered[all.size() - 2] == static_cast<float>(p - 1), gathered[0]);
        // Block j of every rank's input goes to rank j.
        std::vector<float> blocks_v(2 * static_cast<std::size_t>(p));
        for (std::size_t j = 0; j < static_cast<std::size_t>(p); ++j)
          blocks_v[2 * j] = blocks_v[2 * j + 1] =
              static_cast<float>(static_cast<std::size_t>(r) + j);
        const std::vector<float>& blocks = blocks_v;
        std::vector<float> two(2);
        comm.reduce_scatter(blocks, two);
        float expect = 0;
        for (int q = 0; q < p; ++q) expect += static_cast<float>(q + r);
        MP_EXPECT(two[0] == expect && two[1] == expect, two[0]);
        std::vector<float> swapped(blocks.size());
        comm.all_to_all(blocks, swapped);
        MP_EXPECT(swapped[0] == static_cast<float>(r), swapped[0]);  // from rank 0: 0 + r
        std::vector<float> part(2);
        const std::vector<float>& source = blocks;
        comm.scatter(r == 0 ? std::span<const float>(source) : std::span<const float>(), part, 0);
        MP_EXPECT(part[0] == static_cast<float>(r), part[0]);  // rank 0's block r: 0 + r
        if (p > 1) {
          const std::array<std::int64_t, 3> msg{r, r + 1, r + 2};
          std::array<std::int64_t, 3> got{};
          const int to = (r + 1) % p, from = (r + p - 1) % p;
          if (r % 2 == 0) {
            comm.send(msg, to);
            comm.recv(got, from);
          } else {
            comm.recv(got, from);
            comm.send(std::span<const std::int64_t>(msg), to);
          }
          MP_EXPECT(got[0] == from && got[2] == from + 2, got[0]);
        }
      },
      {1, 2, 3});
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
    expect_invalid([&] { comm.all_reduce(ints, static_cast<ddp::ReduceOp>(42)); },
                   "op code 42 (not a ddp::ReduceOp)");
    std::vector<double> doubles(4);
    expect_invalid([&] { comm.all_reduce_as<ddp::bfloat16>(doubles); },
                   "all_reduce_as: `buf` is float64; compression carries float32 values");
    ddp::TensorView<float> nowhere{nullptr, 3};
    expect_invalid([&] { comm.all_reduce(nowhere); }, "has 3 elements but no data");
    ddp::TensorView<float> gpu{a.data(), a.size(), ddp::Device::cuda(0)};
    expect_invalid([&] { comm.all_reduce(gpu); },
                   "is on cuda:0, but backend::host cannot use that memory");
    // Uneven sizes: a count per rank, adding up to the buffer.
    const std::vector<std::size_t> one{4}, two{2, 2}, wrong{3, 3}, huge{~std::size_t{0}, 2};
    expect_invalid([&] { comm.all_to_all(a, c, one, two); },
                   "all_to_all: `in_counts` has 1 entries but must have one per rank (2)");
    expect_invalid([&] { comm.all_to_all(a, c, two, wrong); },
                   "`out` has 8 elements but the `out_counts` add up to 6");
    expect_invalid([&] { comm.all_to_all(a, c, huge, two); },
                   "`in_counts`[0] is 18446744073709551615 (-1 converted");
    expect_invalid(
        [&] {
          comm.all_to_all(c, c, std::vector<std::size_t>{4, 4}, std::vector<std::size_t>{4, 4});
        },
        "must not overlap");
    expect_invalid(
        [&] {
          comm.all_gather(a, b, std::vector<int>{4, -4});
        },
        "all_gather: `counts`[1] is 18446744073709551612 (-4 converted to std::size_t)");
    {  // a batch whose receive shares memory with another op
      const int peer = 1 - comm.rank();
      const ddp::P2POp ring[] = {ddp::P2POp::send(a, peer), ddp::P2POp::recv(a, peer)};
      expect_invalid([&] { (void)comm.batch_isend_irecv(ring); },
                     "batch_isend_irecv: op 1 (a recv) and op 0 (a send) use overlapping memory");
    }
    expect_invalid([&] { comm.all_gather(a, b, wrong); },
                   "all_gather: `out` has 7 elements but the `counts` add up to 6");
    const std::vector<std::size_t> skewed{1, 3};
    expect_invalid(
        [&] { comm.all_gather(std::span<float>(a).first(comm.rank() == 0 ? 3 : 1), a, skewed); },
        "elements but counts[" + std::to_string(comm.rank()) + "] (this rank's) is");
    expect_invalid([&] { comm.gather(a, c, two, 3); }, "gather: root 3");
    expect_invalid([&] { comm.scatter(c, a, wrong, comm.rank()); },
                   "scatter: `in` has 8 elements but the `counts` add up to 6");
    comm.all_reduce(a);  // nothing was sent: the communicator still works
  });
}

TEST_CASE("DDP_HOST_TRANSPORT picks the transport, a bad value is refused") {
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
            // A group split with options of its own takes the setting too.
            ddp::Options o;
            o.timeout = std::chrono::seconds(30);
            auto sub = comm.split(0, 0, o);
            MP_EXPECT(sub.backend().transport() == t,
                      "split: transport " << sub.backend().transport());
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

TEST_CASE("across hosts: DDP_HIERARCHY and the host layout pick the path, bad settings refused") {
  struct Case {
    int world;
    const char* setting;  // DDP_HIERARCHY
    const char* expect;   // hierarchy(), or the error's text
  };
  for (const Case c : {Case{4, "", "slices"}, Case{4, "leaders", "leaders"},
                       Case{4, "flat", "flat"}, Case{3, "", "leaders"},
                       Case{3, "slices",
                            "needs as many ranks on every "
                            "host, but the hosts run 2, 1"},
                       Case{4, "ring",
                            "DDP_HIERARCHY=\"ring\": use auto, flat, slices or "
                            "leaders"}}) {
    CAPTURE(c.world);
    CAPTURE(std::string(c.setting));
    ddp::SpawnOptions so;
    if (*c.setting != '\0') so.env = {std::string("DDP_HIERARCHY=") + c.setting};
    mp::TempDir dir;
    so.stop_on_failure = false;
    so.end_left_out = false;  // fault tests wake the ranks they fence
    try {
      ddp::spawn(
          c.world,
          [&](ddp::Environment env) {
            mp::two_hosts.enter(env.rank, env.world_size);
            std::string got;
            try {
              auto comm = Comm::init(env);
              MP_EXPECT(comm.backend().transport() == "tcp", comm.backend().transport());
              MP_EXPECT(comm.local_size() == (env.rank < 2 ? 2 : env.world_size - 2), "local");
              got = comm.backend().hierarchy();
              std::vector<int> v(5000, env.rank + 1);
              comm.all_reduce(v);
              MP_EXPECT(v[4999] == env.world_size * (env.world_size + 1) / 2, v[4999]);
            } catch (const ddp::Error& e) {
              MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
              got = e.what();
            }
            mp::TempDir::write(dir.file("rank" + std::to_string(env.rank)), got);
          },
          so);
    } catch (const ddp::Error& e) {
      FAIL_CHECK(std::string(e.what()));
    }
    for (int r = 0; r < c.world; ++r) {
      const std::string got = mp::TempDir::read(dir.file("rank" + std::to_string(r)));
      CAPTURE(got);
      CHECK(got.find(c.expect) != std::string::npos);
    }
  }
}

TEST_CASE("across hosts: the combination order is fixed, whatever the path, size and segment") {
  // Values whose float sums round differently in different orders: the result must be bitwise
  // (x0 + x1) + (x2 + x3) for 2 hosts of 2, on every rank, for slices and leaders, small and
  // large buffers and segment sizes; avg divides that by 4. reduce_scatter too.
  const std::size_t n = 300000;
  const auto x = [](int r, std::size_t i) {
    const float big = (i % 3 == 0) ? 1.0e8f : 1.0f;
    return (r % 2 == 0 ? big : 1.0f) *
           (1.0f + 1e-3f * static_cast<float>((i * 7 + static_cast<std::size_t>(r)) % 11)) *
           (r == 2 ? -1.0f : 1.0f);
  };
  for (const char* setting : {"slices", "leaders"}) {
    for (std::size_t segment : {std::size_t{4096}, std::size_t{1} << 20}) {
      CAPTURE(std::string(setting));
      CAPTURE(segment);
      ddp::Options o;
      o.segment_bytes = segment;
      o.hierarchy = std::string(setting) == "slices" ? ddp::HostHierarchy::slices
                                                     : ddp::HostHierarchy::leaders;
      mp::run(
          4, mp::two_hosts,
          [&](Comm& comm) {
            const int r = comm.rank();
            for (std::size_t count : {std::size_t{1}, std::size_t{33}, std::size_t{5000}, n}) {
              for (ddp::ReduceOp op : {ddp::ReduceOp::sum, ddp::ReduceOp::avg}) {
                std::vector<float> v(count);
                for (std::size_t i = 0; i < count; ++i) v[i] = x(r, i);
                comm.all_reduce(v, op);
                for (std::size_t i = 0; i < count; ++i) {
                  float want = (x(0, i) + x(1, i)) + (x(2, i) + x(3, i));
                  if (op == ddp::ReduceOp::avg) want = want / 4.0f;
                  MP_EXPECT(cases::same_bits(v[i], want), "count " << count << " element " << i
                                                                   << ": " << v[i]
                                                                   << " != " << want);
                }
                // reduce_scatter in the same order: a rank's block is bitwise that block of
                // the all_reduce (a fully sharded model's gradients, bitwise DDP's).
                std::vector<float> in(4 * count), out(count);
                for (std::size_t k = 0; k < in.size(); ++k) in[k] = x(r, k);
                comm.reduce_scatter(in, out, op);
                for (std::size_t i = 0; i < count; ++i) {
                  const std::size_t k = static_cast<std::size_t>(r) * count + i;
                  float want = (x(0, k) + x(1, k)) + (x(2, k) + x(3, k));
                  if (op == ddp::ReduceOp::avg) want = want / 4.0f;
                  MP_EXPECT(cases::same_bits(out[i], want), "reduce_scatter: count "
                                                                << count << " element " << i << ": "
                                                                << out[i] << " != " << want);
                }
              }
            }
          },
          o);
    }
  }
}

TEST_CASE("shm all_reduce by single copy: on by default, the same bits as the slot path") {
  // The slot path, single copy off: every dtype and op, counts beyond three segments.
  ddp::Options off;
  off.shm_single_copy_bytes = ddp::Options::never;
  for (int w : {2, 3}) {
    CAPTURE(w);
    mp::run(
        w, ddp::HostTransport::shm,
        [](Comm& comm) {
          MP_EXPECT(comm.backend().single_copy_bytes() == ddp::Options::never,
                    comm.backend().single_copy_bytes());
          cases::all_reduce_every_dtype(comm);
        },
        off);
  }
  // Never on tcp.
  mp::run(2, ddp::HostTransport::tcp, [](Comm& comm) {
    MP_EXPECT(comm.backend().single_copy_bytes() == ddp::Options::never,
              comm.backend().single_copy_bytes());
  });
  // Around the threshold and across segments (with a remainder that does not split evenly),
  // values whose float sums round differently in different orders: bitwise x0 + x1 (+ x2 + x3)
  // in rank order, on every rank, by single copy and by the slot path alike, and when rank 0
  // chooses between them (the default, from 64 KiB here, where the kernel lets a user's
  // processes read each other's memory: each path is tried in turn for each size first, so
  // repeated calls take both).
  const auto x = [](int r, std::size_t i) {
    const float big = (i % 3 == 0) ? 1.0e8f : 1.0f;
    return (r % 2 == 0 ? big : 1.0f) *
           (1.0f + 1e-3f * static_cast<float>((i * 7 + static_cast<std::size_t>(r)) % 11)) *
           (r == 2 ? -1.0f : 1.0f);
  };
  const auto check = [&](Comm& comm, std::size_t count, ddp::ReduceOp op) {
    std::vector<float> v(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = x(comm.rank(), i);
    comm.all_reduce(v, op);
    for (std::size_t i = 0; i < count; ++i) {
      float want = x(0, i);
      for (int j = 1; j < comm.size(); ++j) want = want + x(j, i);
      if (op == ddp::ReduceOp::avg) want = want / static_cast<float>(comm.size());
      MP_EXPECT(cases::same_bits(v[i], want),
                "count " << count << " element " << i << ": " << v[i] << " != " << want);
    }
  };
  for (std::size_t threshold : {std::size_t{0}, std::size_t{4096}, ddp::Options::never}) {
    for (int w : {2, 3, 4}) {
      CAPTURE(threshold);
      CAPTURE(w);
      ddp::Options o;
      o.shm_single_copy_bytes = threshold;
      mp::run(
          w, ddp::HostTransport::shm,
          [&](Comm& comm) {
            const std::size_t want = threshold == 0 ? 64 * 1024 : threshold;
            MP_EXPECT(comm.backend().single_copy_bytes() == want,
                      comm.backend().single_copy_bytes());
            const int repeats = threshold == 0 ? 8 : 1;
            for (std::size_t count :
                 {std::size_t{1023}, std::size_t{1024}, std::size_t{1025}, std::size_t{16384},
                  3 * mp::test_segment / 4 + 1, std::size_t{300001}}) {
              for (int k = 0; k < repeats; ++k) {
                check(comm, count, ddp::ReduceOp::sum);
                check(comm, count, ddp::ReduceOp::avg);
              }
            }
          },
          o);
    }
  }
}
