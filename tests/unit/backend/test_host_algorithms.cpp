// The Host backend's algorithms (backend/host/{flat,single_copy,hierarchy}.hpp) over the
// Transport contract, in one process: ranks are threads of an in-process transport, rounds are
// tiny (so every path runs in many segments), and every result is compared with a reference
// computed here. The real transports run the same algorithms in the multi-process tests.
#include "in_process_transport.hpp"

#include <doctest/doctest.h>
#include <ddp/backend/host/flat.hpp>
#include <ddp/backend/host/hierarchy.hpp>
#include <ddp/backend/host/single_copy.hpp>
#include <ddp/backend/host/uneven.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

using namespace ddp::detail;
using ddp::DType;
using ddp::ReduceOp;
using inproc::Group;

namespace {

constexpr std::size_t tiny_offer = 256;  // bytes a rank offers per round: many segments
constexpr std::size_t tiny_small = 64;   // below this, all_reduce takes its one-round path

Buf buf(std::vector<std::int32_t>& v) {
  return Buf{reinterpret_cast<std::byte*>(v.data()),
             v.size(),
             DType::int32,
             ddp::Device::cpu(),
             nullptr,
             0};
}
Buf buf(std::vector<float>& v) {
  return Buf{reinterpret_cast<std::byte*>(v.data()),
             v.size(),
             DType::float32,
             ddp::Device::cpu(),
             nullptr,
             0};
}

Fingerprint fingerprint(Coll c, std::size_t count, int root = -1, std::uint64_t seq = 0) {
  Fingerprint f;
  f.seq = seq;
  f.count = count;
  f.root = root;
  f.coll = c;
  f.dtype = DType::int32;
  f.op = ReduceOp::sum;
  f.has_op = 1;
  return f;
}

/// Rank r's input: distinct per rank and element, small enough that every sum is exact.
std::int32_t value(int r, std::size_t i) {
  return static_cast<std::int32_t>((r + 1) * 1000 + static_cast<int>(i % 997)) *
         (i % 2 == 0 ? 1 : -1);
}

std::vector<std::int32_t> input(int r, std::size_t n) {
  std::vector<std::int32_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = value(r, i);
  return v;
}

void check_all(const std::vector<std::string>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    CAPTURE(r);
    CHECK(errors[r] == "");
  }
}

const std::vector<int> worlds = {1, 2, 3, 4, 5};
const std::vector<std::size_t> counts = {0, 1, 7, 15, 16, 17, 64, 1000, 4099};

}  // namespace

TEST_CASE("host algorithms in one process: all_reduce and reduce, every path, sum, max and min") {
  for (int p : worlds) {
    for (std::size_t n : counts) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
        const std::string op_name{ddp::to_string(op)};
        CAPTURE(p);
        CAPTURE(n);
        CAPTURE(op_name);
        std::vector<std::int32_t> want(n);
        for (std::size_t i = 0; i < n; ++i) {
          std::int32_t acc = value(0, i);
          for (int r = 1; r < p; ++r) {
            const std::int32_t x = value(r, i);
            acc = op == ReduceOp::sum   ? acc + x
                  : op == ReduceOp::max ? std::max(acc, x)
                                        : std::min(acc, x);
          }
          want[i] = acc;
        }
        Group g(p), g2(p);
        const int root = p - 1;
        std::vector<std::vector<std::int32_t>> reduced(static_cast<std::size_t>(p));
        check_all(inproc::run_ranks(
            p,
            [&](int r) {
              inproc::Transport t(g, r, tiny_offer, tiny_small);
              RoundScratch s;
              SingleCopy none;
              auto v = input(r, n);
              const auto fp = fingerprint(Coll::all_reduce, n);
              all_reduce_on(t, s, buf(v), reduce_fn(DType::int32, op), &fp, &none);
              if (v != want)
                ddp::detail::fail(ddp::Errc::backend, "all_reduce differs on rank ", r);
              inproc::Transport t2(g2, r, tiny_offer, tiny_small);
              auto w = input(r, n);
              const auto fp2 = fingerprint(Coll::reduce, n, root, 1);
              reduce_on(t2, s, buf(w), reduce_fn(DType::int32, op), root, &fp2);
              reduced[static_cast<std::size_t>(r)] = w;
            },
            {&g, &g2}));
        CHECK(reduced[static_cast<std::size_t>(root)] == want);
        for (int r = 0; r < root; ++r) CHECK(reduced[static_cast<std::size_t>(r)] == input(r, n));
      }
    }
  }
}

TEST_CASE("host algorithms in one process: broadcast, gather, all_gather, scatter") {
  for (int p : worlds) {
    for (std::size_t n : counts) {
      CAPTURE(p);
      CAPTURE(n);
      const int root = p / 2;
      Group g(p);
      std::vector<std::string> errors = inproc::run_ranks(
          p,
          [&](int r) {
            inproc::Transport t(g, r, tiny_offer, tiny_small);
            RoundScratch s;
            // broadcast
            auto v = input(r, n);
            broadcast_on(t, buf(v), root, nullptr);
            if (v != input(root, n)) fail(ddp::Errc::backend, "broadcast differs on rank ", r);
            // all_gather and gather
            for (int to : {-1, root}) {
              auto in = input(r, n);
              std::vector<std::int32_t> out(n * static_cast<std::size_t>(p), 7);
              gather_on(t, buf(in), buf(out), to, fingerprint(Coll::all_gather, n, to));
              if (to >= 0 && r != to) {
                if (!std::all_of(out.begin(), out.end(), [](std::int32_t x) { return x == 7; }))
                  fail(ddp::Errc::backend, "gather wrote on a rank other than root");
                continue;
              }
              for (int j = 0; j < p; ++j) {
                const auto w = input(j, n);
                if (!std::equal(
                        w.begin(), w.end(),
                        out.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(j) * n)))
                  fail(ddp::Errc::backend, "gather: block ", j, " differs on rank ", r);
              }
            }
            // scatter: root's block j to rank j
            auto all = input(r, n * static_cast<std::size_t>(p));
            std::vector<std::int32_t> mine(n);
            scatter_on(t, s, buf(all), buf(mine), root, fingerprint(Coll::scatter, n, root));
            const auto rootall = input(root, n * static_cast<std::size_t>(p));
            if (!std::equal(
                    mine.begin(), mine.end(),
                    rootall.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r) * n)))
              fail(ddp::Errc::backend, "scatter differs on rank ", r);
          },
          {&g});
      check_all(errors);
    }
  }
}

TEST_CASE("host algorithms in one process: reduce_scatter and all_to_all") {
  for (int p : worlds) {
    for (std::size_t n : counts) {
      CAPTURE(p);
      CAPTURE(n);
      Group g(p);
      const auto total = n * static_cast<std::size_t>(p);
      check_all(inproc::run_ranks(
          p,
          [&](int r) {
            inproc::Transport t(g, r, tiny_offer, tiny_small);
            RoundScratch s;
            auto in = input(r, total);
            std::vector<std::int32_t> out(n);
            reduce_scatter_on(t, s, buf(in), buf(out), reduce_fn(DType::int32, ReduceOp::sum),
                              fingerprint(Coll::reduce_scatter, n));
            for (std::size_t i = 0; i < n; ++i) {
              std::int32_t acc = 0;
              for (int j = 0; j < p; ++j) acc += value(j, static_cast<std::size_t>(r) * n + i);
              if (out[i] != acc) fail(ddp::Errc::backend, "reduce_scatter differs on rank ", r);
            }
            std::vector<std::int32_t> got(total);
            all_to_all_on(t, s, buf(in), buf(got), fingerprint(Coll::all_to_all, n));
            for (int j = 0; j < p; ++j) {
              for (std::size_t i = 0; i < n; ++i) {
                if (got[static_cast<std::size_t>(j) * n + i] !=
                    value(j, static_cast<std::size_t>(r) * n + i))
                  fail(ddp::Errc::backend, "all_to_all differs on rank ", r);
              }
            }
          },
          {&g}));
    }
  }
}

TEST_CASE("host algorithms in one process: the collectives with a count per rank, many rounds") {
  for (int p : worlds) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{300}}) {
      CAPTURE(p);
      CAPTURE(n);
      // Elements rank i sends rank j: zeros, small counts and, from rank 0, n more.
      const auto c = [&](int i, int j) {
        return static_cast<std::size_t>((i * 3 + j * 5) % 4) + (i == 0 ? n : 0);
      };
      const auto up = static_cast<std::size_t>(p);
      Group g(p);
      check_all(inproc::run_ranks(
          p,
          [&](int r) {
            inproc::Transport t(g, r, tiny_offer, tiny_small);
            RoundScratch s;
            std::vector<std::size_t> ins(up), outs(up);
            std::vector<std::int32_t> in, want;
            for (int j = 0; j < p; ++j) {
              ins[static_cast<std::size_t>(j)] = c(r, j);
              outs[static_cast<std::size_t>(j)] = c(j, r);
              for (std::size_t i = 0; i < c(r, j); ++i)
                in.push_back(value(r, static_cast<std::size_t>(j) * 1000 + i));
              for (std::size_t i = 0; i < c(j, r); ++i)
                want.push_back(value(j, static_cast<std::size_t>(r) * 1000 + i));
            }
            std::vector<std::int32_t> out(want.size());
            all_to_all_v_on(t, s, buf(in), buf(out), ins, outs, fingerprint(Coll::all_to_all_v, 0));
            if (out != want) fail(ddp::Errc::backend, "all_to_all (uneven) differs on rank ", r);
            // all_gather and gather: rank j offers c(j, 0) elements.
            std::vector<std::size_t> sizes(up);
            std::vector<std::int32_t> every;
            for (int j = 0; j < p; ++j) {
              sizes[static_cast<std::size_t>(j)] = c(j, 0);
              for (std::size_t i = 0; i < c(j, 0); ++i) every.push_back(value(j, i));
            }
            auto mine = input(r, c(r, 0));
            std::vector<std::int32_t> all(every.size());
            gather_v_on(t, s, buf(mine), buf(all), sizes, -1, fingerprint(Coll::all_gather_v, 0));
            if (all != every) fail(ddp::Errc::backend, "all_gather (uneven) differs on rank ", r);
            const int root = p - 1;
            std::vector<std::int32_t> g2(r == root ? every.size() : 0);
            gather_v_on(t, s, buf(mine), buf(g2), sizes, root,
                        fingerprint(Coll::gather_v, 0, root, 1));
            if (r == root && g2 != every)
              fail(ddp::Errc::backend, "gather (uneven) differs on rank ", r);
            // scatter: root's block j (c(root, j) elements) to rank j.
            std::vector<std::size_t> sc(up);
            std::vector<std::int32_t> src;
            for (int j = 0; j < p; ++j) {
              sc[static_cast<std::size_t>(j)] = c(root, j);
              for (std::size_t i = 0; i < c(root, j); ++i)
                src.push_back(value(root, static_cast<std::size_t>(j) * 1000 + i));
            }
            if (r != root) src.clear();
            std::vector<std::int32_t> part(c(root, r));
            scatter_v_on(t, s, buf(src), buf(part), sc, root,
                         fingerprint(Coll::scatter_v, 0, root, 2));
            for (std::size_t i = 0; i < part.size(); ++i) {
              if (part[i] != value(root, static_cast<std::size_t>(r) * 1000 + i))
                fail(ddp::Errc::backend, "scatter (uneven) differs on rank ", r);
            }
          },
          {&g}));
    }
  }
}

TEST_CASE("host algorithms in one process: all_reduce carried as float16 and bfloat16") {
  for (int p : {2, 3, 4}) {
    for (std::size_t n : {std::size_t{5}, std::size_t{300}}) {
      for (DType wire : {DType::float16, DType::bfloat16}) {
        const std::string wire_name{ddp::to_string(wire)};
        CAPTURE(p);
        CAPTURE(n);
        CAPTURE(wire_name);
        Group g(p);
        check_all(inproc::run_ranks(
            p,
            [&](int r) {
              inproc::Transport t(g, r, tiny_offer, tiny_small);
              RoundScratch s;
              std::vector<float> v(n);
              for (std::size_t i = 0; i < n; ++i)
                v[i] = static_cast<float>(static_cast<std::size_t>(r + 1) * (i % 13));
              Fingerprint fp = fingerprint(Coll::all_reduce, n);
              fp.dtype = wire;
              all_reduce_as_on(t, s, buf(v), wire_kernels(wire, ReduceOp::sum), ddp::size_of(wire),
                               fp);
              for (std::size_t i = 0; i < n; ++i) {  // small integers: exact in either wire type
                const float want = static_cast<float>(p * (p + 1) / 2) * static_cast<float>(i % 13);
                if (v[i] != want) fail(ddp::Errc::backend, "all_reduce_as differs on rank ", r);
              }
            },
            {&g}));
      }
    }
  }
}

TEST_CASE("host algorithms in one process: ranks that call different collectives fail together") {
  for (int p : {2, 3}) {
    CAPTURE(p);
    Group g(p);
    const auto errors = inproc::run_ranks(p, [&](int r) {
      inproc::Transport t(g, r, tiny_offer, tiny_small);
      RoundScratch s;
      SingleCopy none;
      auto v = input(r, 100 + static_cast<std::size_t>(r == 1));  // rank 1: one more element
      const auto fp = fingerprint(Coll::all_reduce, v.size());
      all_reduce_on(t, s, buf(v), reduce_fn(DType::int32, ReduceOp::sum), &fp, &none);
    });
    for (const std::string& e : errors) {
      CAPTURE(e);
      CHECK(e.find("mismatched collectives") != std::string::npos);
      CHECK(e.find("count=101") != std::string::npos);
    }
  }
}

TEST_CASE("host algorithms in one process: the hierarchical all_reduce, slices and leaders") {
  // Ranks {0, 1} on host 0 and {2, 3} on host 1 (slices: 0+2 and 1+3 cross; leaders: 0+2), or
  // {0, 1} and {2} (leaders). Each host sums in rank order, then the hosts in host order.
  struct Layout {
    std::vector<int> host;  // host of each rank
    ddp::HostHierarchy kind;
  };
  for (const Layout& l : {Layout{{0, 0, 1, 1}, ddp::HostHierarchy::slices},
                          Layout{{0, 0, 1, 1}, ddp::HostHierarchy::leaders},
                          Layout{{0, 0, 1}, ddp::HostHierarchy::leaders}}) {
    for (std::size_t n : {std::size_t{3}, std::size_t{1000}}) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
        const int p = static_cast<int>(l.host.size());
        const std::string op_name{ddp::to_string(op)};
        const std::string kind = l.kind == ddp::HostHierarchy::slices ? "slices" : "leaders";
        CAPTURE(p);
        CAPTURE(n);
        CAPTURE(op_name);
        CAPTURE(kind);
        const auto local_of = [&](int r) {
          return static_cast<int>(
              std::count(l.host.begin(), l.host.begin() + r, l.host[static_cast<std::size_t>(r)]));
        };
        std::vector<std::unique_ptr<Group>> hosts, across;
        for (int h = 0; h < 2; ++h)
          hosts.push_back(std::make_unique<Group>(
              static_cast<int>(std::count(l.host.begin(), l.host.end(), h))));
        for (int i = 0; i < 2; ++i) across.push_back(std::make_unique<Group>(2));
        std::vector<float> want(n);
        for (std::size_t i = 0; i < n; ++i) {
          float sum = 0;
          for (int r = 0; r < p; ++r) sum += static_cast<float>(value(r, i));
          want[i] = sum;
        }
        if (op == ReduceOp::avg)  // the kernel's division: this tests the hierarchy, not it
          divide_fn(DType::float32)(reinterpret_cast<std::byte*>(want.data()), n, p);
        check_all(inproc::run_ranks(
            p,
            [&](int r) {
              const int h = l.host[static_cast<std::size_t>(r)], lr = local_of(r);
              Hierarchy hier;
              hier.kind = l.kind;
              hier.rank = r;
              hier.local = std::make_unique<inproc::Transport>(*hosts[static_cast<std::size_t>(h)],
                                                               lr, tiny_offer, tiny_small);
              if (l.kind == ddp::HostHierarchy::slices || lr == 0)
                hier.across = std::make_unique<inproc::Transport>(
                    *across[static_cast<std::size_t>(lr)], h, tiny_offer, tiny_small);
              RoundScratch s;
              SingleCopy none;
              std::vector<float> v(n);
              for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(value(r, i));
              Fingerprint fp = fingerprint(Coll::all_reduce, n);
              fp.dtype = DType::float32;
              fp.op = op;
              hier.all_reduce(s, none, buf(v), op, fp, p);
              if (v != want)
                fail(ddp::Errc::backend, "hierarchical all_reduce differs on rank ", r);
            },
            {hosts[0].get(), hosts[1].get(), across[0].get(), across[1].get()}));
      }
    }
  }
}
