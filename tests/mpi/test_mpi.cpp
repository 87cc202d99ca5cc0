// backend::Mpi under Open MPI's mpirun (-np 1, 2 and 4): the same collective cases and
// references as the backend::Host tests (tests/unit/collective_cases.hpp), plus what is
// particular to MPI (adoption of MPI, the p2p header, the watchdog, the training layer on top).
// Every rank runs doctest; a failing check on any rank makes mpirun exit non-zero.
//
// DDP_MPI_TEST_MODE=collective-timeout runs no test cases: rank 0 calls an all_reduce that the
// other ranks skip, and the watchdog must end the job naming it (checked by CTest's output regex).
#define DOCTEST_CONFIG_IMPLEMENT
#include "../unit/collective_cases.hpp"

#include <ddp/backend/mpi.hpp>
#include <ddp/training/averaging/join.hpp>
#include <ddp/training/fully_sharded/fully_shard.hpp>
#include <ddp/training/fully_sharded/fully_sharded.hpp>
#include <ddp/training/zero/sharded.hpp>

#include <mpi.h>

#include <cstdlib>
#include <string>
#include <thread>

namespace {

using Mpi = ddp::Communicator<ddp::backend::Mpi>;
using namespace std::chrono_literals;

Mpi& world() {
  static Mpi comm = [] {
    ddp::Options o;
    o.timeout = 60s;
    return Mpi::init(ddp::Environment::detect(), o);
  }();
  return comm;
}

/// Runs a case body; MP_EXPECT's exceptions become doctest failures naming the rank.
template <class F>
void on_world(F&& body) {
  try {
    body(world());
  } catch (const std::exception& e) {
    FAIL_CHECK("rank " << world().rank() << ": " << std::string(e.what()));
  }
}

}  // namespace

TEST_CASE("ddp initializes MPI itself, rank and size are MPI's") {
  auto& comm = world();
  int initialized = 0, level = 0, rank = -1, size = 0;
  MPI_Initialized(&initialized);
  MPI_Query_thread(&level);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CHECK(initialized == 1);
  CHECK(level >= MPI_THREAD_SERIALIZED);
  CHECK(comm.rank() == rank);
  CHECK(comm.size() == size);
  const auto env = ddp::Environment::detect();
  CHECK(env.rank == rank);
  CHECK(env.world_size == size);
  // The processes on this host, as MPI finds them (one host, or two network namespaces in the
  // multi-node mpirun test) and as mpirun's environment says.
  CHECK(comm.local_size() == env.local_world_size);
  CHECK(comm.local_rank() == env.local_rank);
  int cmp = MPI_UNEQUAL;
  MPI_Comm_compare(comm.backend().comm(), MPI_COMM_WORLD, &cmp);
  CHECK(cmp == MPI_CONGRUENT);  // a duplicate: ddp's traffic never matches the program's
}

TEST_CASE("shrink is refused on backend::Mpi, naming what it would need") {
  try {
    (void)world().shrink();
    FAIL_CHECK("shrink accepted");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::unsupported);
    CHECK(std::string(e.what()).find("ULFM fault tolerance (MPIX_Comm_shrink") !=
          std::string::npos);
  }
  std::vector<float> v{1.0f};
  world().all_reduce(v);  // the communicator still works
  CHECK(v[0] == static_cast<float>(world().size()));
}

TEST_CASE("all_reduce: every dtype, op and count, sync and async") {
  on_world([](Mpi& c) { cases::all_reduce_every_dtype(c); });
}
TEST_CASE("reduce: the root gets the reduction, the others keep their buffers") {
  on_world([](Mpi& c) { cases::reduce_to_root(c); });
}
TEST_CASE("premul_sum in every reducing collective, bitwise ops refused on floating point") {
  on_world([](Mpi& c) { cases::premul_sum_every_form(c); });
}
TEST_CASE("named roles: ddp::from(in), ddp::into(out) in every buffer-pair collective") {
  on_world([](Mpi& c) { cases::named_roles(c); });
}
TEST_CASE("broadcast: every dtype, count and root") {
  on_world([](Mpi& c) { cases::broadcast_every_root(c); });
}
TEST_CASE("all_gather and gather, including in place") {
  on_world([](Mpi& c) { cases::all_gather_and_gather(c); });
}
TEST_CASE("scatter, reduce_scatter and all_to_all") {
  on_world([](Mpi& c) { cases::scatter_reduce_scatter_all_to_all(c); });
}

TEST_CASE("uneven sizes: all_to_all with split sizes, all_gather, gather and scatter with counts") {
  on_world([](Mpi& c) { cases::uneven_collectives(c); });
}
TEST_CASE("batch_isend_irecv: every pair at once, beyond a channel, against plain send/recv") {
  on_world([](Mpi& c) { cases::batch_p2p(c); });
}
TEST_CASE("send and recv around a ring, and barrier") {
  on_world([](Mpi& c) {
    if (c.size() > 1) cases::send_recv_ring(c);
  });
}
TEST_CASE("async operations complete in issue order, interleaved with sync ones") {
  on_world([](Mpi& c) { cases::async_in_issue_order(c); });
}

TEST_CASE("run-time-typed tensors (ddp::DynamicView): every dtype through every collective") {
  on_world([](Mpi& c) {
    const cases::AsRuntime wrap;
    cases::all_reduce_every_dtype(c, wrap);
    cases::reduce_to_root(c, wrap);
    cases::broadcast_every_root(c, wrap);
    cases::all_gather_and_gather(c, wrap);
    cases::scatter_reduce_scatter_all_to_all(c, wrap);
    cases::uneven_collectives(c, wrap);
    cases::all_reduce_coalesced(c, wrap);
    cases::premul_sum_every_form(c, wrap);
    if (c.size() > 1) cases::send_recv_ring(c, wrap);
    cases::async_in_issue_order(c, wrap);
  });
}

TEST_CASE("all_reduce_coalesced") {
  on_world([](Mpi& c) { cases::all_reduce_coalesced(c); });
}
TEST_CASE("all_reduce_as: float32 carried as half or bfloat16 (converted around MPI_Allreduce)") {
  on_world([](Mpi& c) { cases::all_reduce_compressed(c); });
}
TEST_CASE("all_reduce_host and broadcast_host: small host values, exact_mean, ZeroFirstGuard") {
  on_world([](Mpi& c) { cases::host_values(c); });
}
TEST_CASE("split: MPI_Comm_split groups by color, ordered by key") {
  on_world([](Mpi& c) { cases::split_by_color(c); });
}
TEST_CASE("object collectives") {
  on_world([](Mpi& c) { cases::object_collectives(c); });
}

TEST_CASE("bad arguments fail before anything is sent") {
  on_world([](Mpi& comm) {
    std::vector<int> ints(3);
    try {
      comm.all_reduce(ints, ddp::ReduceOp::avg);
      MP_EXPECT(false, "avg on int32 was accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
    }
    std::vector<float> a(4);
    ddp::TensorView<float> gpu{a.data(), a.size(), ddp::Device::cuda(0)};
    if (!ddp::backend::Mpi::cuda_aware()) {
      try {
        comm.all_reduce(gpu);
        MP_EXPECT(false, "a CUDA buffer was accepted by a MPI that is not CUDA-aware");
      } catch (const ddp::Error& e) {
        MP_EXPECT(
            std::string(e.what()).find("backend::mpi cannot use that memory") != std::string::npos,
            e.what());
      }
    }
    comm.all_reduce(ints);  // still usable
  });
}

TEST_CASE("recv checks the sender's tag, dtype and count, p2p waits time out") {
  on_world([](Mpi& comm) {
    if (comm.size() < 2) return;
    const int r = comm.rank();
    {
      auto pair = comm.split(r < 2 ? 0 : Mpi::no_color);
      if (pair.valid()) {
        std::vector<float> v(3, 1.0f);
        if (r == 0) {
          pair.send(v, 1, 5);
        } else {
          try {
            pair.recv(v, 0, 6);
            MP_EXPECT(false, "a send with tag 5 matched a recv with tag 6");
          } catch (const ddp::Error& e) {
            MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
            MP_EXPECT(
                std::string(e.what()).find("rank 0 sent tag 5, float32 x 3") != std::string::npos,
                e.what());
          }
        }
      }
    }
    comm.barrier();
    {
      // A communicator with a short timeout (init is collective: MPI_Comm_dup); rank 0 never sends.
      ddp::Options o;
      o.timeout = 300ms;
      auto quick = Mpi::init(ddp::Environment::detect(), o);
      if (r == 1) {
        std::vector<float> v(3);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          quick.recv(v, 0, 0);
          MP_EXPECT(false, "a recv with no sender returned");
        } catch (const ddp::Error& e) {
          const auto waited = std::chrono::steady_clock::now() - t0;
          MP_EXPECT(e.code() == ddp::Errc::timeout, e.what());
          MP_EXPECT(waited >= 300ms && waited < 5s, "waited " << (waited / 1ms) << " ms");
        }
      }
    }
    comm.barrier();
  });
}

namespace {
struct Param {
  std::vector<float> value, grad;
};
}  // namespace

TEST_CASE("GradientAverager works unchanged on backend::Mpi") {
  on_world([](Mpi& comm) {
    const int r = comm.rank(), p = comm.size();
    std::vector<Param> model;
    for (std::size_t n : {std::size_t{3}, std::size_t{100000}, std::size_t{7}}) {
      model.push_back({std::vector<float>(n, static_cast<float>(r)), std::vector<float>(n)});
    }
    ddp::BucketOptions o;
    o.bucket_bytes = 64 * 1024;
    o.first_bucket_bytes = 1024;
    ddp::GradientAverager avg(comm, model, o);  // broadcasts rank 0's values
    for (auto& prm : model) {
      MP_EXPECT(prm.value.front() == 0.0f && prm.value.back() == 0.0f, "rank 0's values");
      for (std::size_t i = 0; i < prm.grad.size(); ++i)
        prm.grad[i] = static_cast<float>(r + 1) * static_cast<float>(i % 7);
    }
    for (std::size_t k = model.size(); k-- > 0;) avg.mark_ready(k);
    avg.synchronize();
    const float mean = static_cast<float>(p + 1) / 2.0f;
    for (auto& prm : model) {
      for (std::size_t i = 0; i < prm.grad.size(); ++i) {
        const float want = mean * static_cast<float>(i % 7);
        MP_EXPECT(std::abs(prm.grad[i] - want) <= 1e-5f * std::max(1.0f, want),
                  "grad " << i << " = " << prm.grad[i] << ", expected " << want);
      }
    }
  });
}

TEST_CASE("ShardedAverager on backend::Mpi: momentum SGD equals GradientAverager's, state 1/P") {
  on_world([](Mpi& comm) {
    const int r = comm.rank(), p = comm.size();
    const auto make = [] {
      std::vector<Param> m;
      for (std::size_t n :
           {std::size_t{37}, std::size_t{100003}, std::size_t{5}, std::size_t{1000}})
        m.push_back({std::vector<float>(n, 0.5f), std::vector<float>(n)});
      return m;
    };
    std::vector<Param> full = make(), net = make();
    ddp::GradientAverager avg(comm, full);
    ddp::BucketOptions o;
    o.first_bucket_bytes = 256;  // several small buckets and one in place (with a leftover)
    o.bucket_bytes = 2048;
    ddp::ShardedAverager zero(comm, net, o);
    // Momentum buffers: the whole model's, and the shard's.
    std::vector<std::vector<float>> mom_full, mom;
    for (auto& prm : full) mom_full.emplace_back(prm.value.size(), 0.0f);
    for (auto& s : zero.shard()) mom.emplace_back(s.value.size, 0.0f);
    const auto grads = [&](std::vector<Param>& m, int step) {
      for (auto& prm : m)
        for (std::size_t i = 0; i < prm.grad.size(); ++i)
          prm.grad[i] =
              prm.value[i] - std::sin(0.01f * static_cast<float>(i) + static_cast<float>(r + step));
    };
    for (int step = 0; step < 10; ++step) {
      grads(full, step);
      avg.average();
      for (std::size_t j = 0; j < full.size(); ++j)
        for (std::size_t i = 0; i < full[j].value.size(); ++i) {
          mom_full[j][i] = 0.9f * mom_full[j][i] + full[j].grad[i];
          full[j].value[i] -= 0.1f * mom_full[j][i];
        }
      grads(net, step);
      zero.step([&](std::span<ddp::ShardSlice<float>> shard) {
        for (std::size_t j = 0; j < shard.size(); ++j)
          for (std::size_t i = 0; i < shard[j].value.size; ++i) {
            mom[j][i] = 0.9f * mom[j][i] + shard[j].grad.data[i];
            shard[j].value.data[i] -= 0.1f * mom[j][i];
          }
      });
    }
    for (std::size_t j = 0; j < full.size(); ++j)
      for (std::size_t i = 0; i < full[j].value.size(); ++i) {
        const float a = net[j].value[i], b = full[j].value[i];
        MP_EXPECT(std::abs(a - b) <= 1e-6f * std::max(1e-3f, std::abs(b)),
                  "parameter " << j << "[" << i << "]: " << a << " vs " << b);
      }
    std::size_t state = 0;
    for (const auto& m : mom) state += m.size();
    MP_EXPECT(state == zero.shard_size() &&
                  state <= zero.total_size() / static_cast<std::size_t>(p) + zero.buckets().size(),
              "momentum for " << state << " of " << zero.total_size() << " elements");
  });
}

TEST_CASE(
    "FullyShardedAverager on backend::Mpi: units gathered, prefetched and reduce-scattered, "
    "momentum SGD equals GradientAverager's, and a Join's finished ranks keep their shards "
    "current") {
  on_world([](Mpi& comm) {
    const int r = comm.rank();
    const std::vector<std::vector<std::size_t>> units{{37, 1001}, {3, 129, 1}, {50002, 64}};
    const auto initial = [](std::size_t u, std::size_t i, std::size_t k) {
      return 0.5f * std::sin(0.3f * static_cast<float>(k) + static_cast<float>(7 * u + i));
    };
    // The gradient of element k of parameter i of unit u, given its value.
    const auto gradient = [&](std::size_t u, std::size_t i, std::size_t k, float v, int step) {
      return v - std::cos(0.01f * static_cast<float>(k) + static_cast<float>(3 * u + i) +
                          static_cast<float>(r + step));
    };
    std::vector<Param> full;
    for (std::size_t u = 0; u < units.size(); ++u)
      for (std::size_t i = 0; i < units[u].size(); ++i) {
        Param prm{std::vector<float>(units[u][i]), std::vector<float>(units[u][i])};
        for (std::size_t k = 0; k < prm.value.size(); ++k) prm.value[k] = initial(u, i, k);
        full.push_back(std::move(prm));
      }
    ddp::GradientAverager avg(comm, full);
    ddp::FullyShardedAverager fsdp(
        comm, units, [&](std::size_t u, std::size_t i, std::size_t offset, std::span<float> v) {
          for (std::size_t k = 0; k < v.size(); ++k) v[k] = initial(u, i, offset + k);
        });
    std::vector<std::vector<float>> mom_full, mom;
    for (auto& prm : full) mom_full.emplace_back(prm.value.size(), 0.0f);
    for (auto& sl : fsdp.shard()) mom.emplace_back(sl.value.size, 0.0f);
    const auto sgd = [&](std::span<ddp::ShardSlice<float>> shard) {
      for (std::size_t j = 0; j < shard.size(); ++j)
        for (std::size_t i = 0; i < shard[j].value.size; ++i) {
          mom[j][i] = 0.9f * mom[j][i] + shard[j].grad.data[i];
          shard[j].value.data[i] -= 0.1f * mom[j][i];
        }
    };
    for (int step = 0; step < 8; ++step) {
      std::size_t j = 0;
      for (std::size_t u = 0; u < units.size(); ++u)
        for (std::size_t i = 0; i < units[u].size(); ++i, ++j)
          for (std::size_t k = 0; k < full[j].value.size(); ++k)
            full[j].grad[k] = gradient(u, i, k, full[j].value[k], step);
      avg.average();
      for (std::size_t q = 0; q < full.size(); ++q)
        for (std::size_t k = 0; k < full[q].value.size(); ++k) {
          mom_full[q][k] = 0.9f * mom_full[q][k] + full[q].grad[k];
          full[q].value[k] -= 0.1f * mom_full[q][k];
        }
      fsdp.prefetch(units.size() - 1);
      for (std::size_t u = units.size(); u-- > 0;) {  // the backward: last unit first
        const std::span<float> w = fsdp.gather(u);
        if (u > 0) fsdp.prefetch(u - 1);
        const std::span<float> g = fsdp.grad(u);
        std::size_t at = 0;
        for (std::size_t i = 0; i < units[u].size(); ++i)
          for (std::size_t k = 0; k < units[u][i]; ++k, ++at)
            g[at] += gradient(u, i, k, w[at], step);
        fsdp.release(u);
        fsdp.reduce(u);
      }
      fsdp.synchronize();
      auto shard = fsdp.shard();
      sgd(shard);
    }
    std::size_t q = 0;
    fsdp.gather_to(0, [&](std::size_t, std::size_t, std::span<const float> v) {
      for (std::size_t k = 0; k < v.size(); ++k) {
        const float a = v[k], b = full[q].value[k];
        MP_EXPECT(std::abs(a - b) <= 1e-5f * std::max(1e-2f, std::abs(b)),
                  "parameter " << q << "[" << k << "]: " << a << " vs " << b);
      }
      ++q;
    });
    MP_EXPECT(r != 0 || q == full.size(), "gather_to handed " << q << " parameters");
    // Uneven inputs: rank r trains 1 + r steps; the finished ranks answer the others' steps.
    fsdp.on_join_step([&](std::vector<ddp::ShardSlice<float>> shard) { sgd(shard); });
    {
      ddp::Join join(comm, {&fsdp});
      for (int step = 0; step < 1 + r; ++step) {
        (void)join.step();
        for (std::size_t u = units.size(); u-- > 0;) {
          const std::span<float> w = fsdp.gather(u);
          const std::span<float> g = fsdp.grad(u);
          for (std::size_t k = 0; k < g.size(); ++k) g[k] += w[k];
          fsdp.release(u);
          fsdp.reduce(u);
        }
        fsdp.synchronize();
        auto shard = fsdp.shard();
        sgd(shard);
      }
      join.finish();
    }
    // Every gradient was the value itself (the same on every rank): comm.size() steps of it on
    // the whole model, which the finished ranks' shards must have followed too.
    for (int step = 0; step < comm.size(); ++step)
      for (std::size_t j = 0; j < full.size(); ++j)
        for (std::size_t k = 0; k < full[j].value.size(); ++k) {
          mom_full[j][k] = 0.9f * mom_full[j][k] + full[j].value[k];
          full[j].value[k] -= 0.1f * mom_full[j][k];
        }
    q = 0;
    fsdp.gather_to(0, [&](std::size_t, std::size_t, std::span<const float> v) {
      for (std::size_t k = 0; k < v.size(); ++k) {
        const float x = v[k], y = full[q].value[k];
        MP_EXPECT(std::abs(x - y) <= 1e-4f * std::max(1e-2f, std::abs(y)),
                  "after the Join, parameter " << q << "[" << k << "]: " << x << " vs " << y);
      }
      ++q;
    });
  });
}

TEST_CASE(
    "FullyShard on backend::Mpi: a model of span parameters re-pointed at each unit, momentum "
    "SGD equals GradientAverager's, units in different orders refused") {
  on_world([](Mpi& comm) {
    const int r = comm.rank();
    struct Span {
      std::span<float> value, grad;
    };
    const std::vector<std::size_t> sizes{37, 1001, 3, 129, 1, 20002, 64};
    const std::vector<std::vector<std::size_t>> units{{0, 1}, {2, 3, 4}, {5, 6}};
    std::vector<Param> full;
    std::vector<std::vector<float>> memory;
    std::vector<Span> net;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      Param prm{std::vector<float>(sizes[i]), std::vector<float>(sizes[i])};
      for (std::size_t k = 0; k < sizes[i]; ++k)
        prm.value[k] = 0.5f * std::sin(0.3f * static_cast<float>(k) + static_cast<float>(i));
      memory.push_back(prm.value);
      full.push_back(std::move(prm));
    }
    for (auto& m : memory) net.push_back({m, {}});
    const auto gradient = [&](std::size_t i, std::size_t k, float v, int step) {
      return v - std::cos(0.01f * static_cast<float>(k) + static_cast<float>(i) +
                          static_cast<float>(r + step));
    };
    ddp::GradientAverager avg(comm, full);
    ddp::FullyShard fsdp(comm, net, units);
    std::vector<std::vector<float>> mom_full, mom;
    for (auto& prm : full) mom_full.emplace_back(prm.value.size(), 0.0f);
    for (auto& sl : fsdp.shard()) mom.emplace_back(sl.value.size, 0.0f);
    for (int step = 0; step < 6; ++step) {
      for (std::size_t i = 0; i < full.size(); ++i)
        for (std::size_t k = 0; k < full[i].value.size(); ++k)
          full[i].grad[k] = gradient(i, k, full[i].value[k], step);
      avg.average();
      for (std::size_t q = 0; q < full.size(); ++q)
        for (std::size_t k = 0; k < full[q].value.size(); ++k) {
          mom_full[q][k] = 0.9f * mom_full[q][k] + full[q].grad[k];
          full[q].value[k] -= 0.1f * mom_full[q][k];
        }
      for (std::size_t u = 0; u < units.size(); ++u) fsdp.forward(u, [] {});
      for (std::size_t u = units.size(); u-- > 0;)
        fsdp.backward(u, [&] {
          for (const std::size_t i : units[u])
            for (std::size_t k = 0; k < net[i].value.size(); ++k)
              net[i].grad[k] += gradient(i, k, net[i].value[k], step);
        });
      fsdp.step([&](std::vector<ddp::ShardSlice<float>> shard) {
        for (std::size_t j = 0; j < shard.size(); ++j)
          for (std::size_t k = 0; k < shard[j].value.size; ++k) {
            mom[j][k] = 0.9f * mom[j][k] + shard[j].grad.data[k];
            shard[j].value.data[k] -= 0.1f * mom[j][k];
          }
      });
    }
    std::size_t seen = 0;
    fsdp.averager().gather_to(0, [&](std::size_t u, std::size_t i, std::span<const float> v) {
      const auto& want = full[units[u][i]].value;
      for (std::size_t k = 0; k < v.size(); ++k)
        MP_EXPECT(std::abs(v[k] - want[k]) <= 1e-5f * std::max(1e-2f, std::abs(want[k])),
                  "parameter " << units[u][i] << "[" << k << "]: " << v[k] << " vs " << want[k]);
      ++seen;
    });
    MP_EXPECT(r != 0 || seen == full.size(), "gather_to handed " << seen << " parameters");
    // Two units of one size run in opposite orders on the ranks: refused at the step.
    if (comm.size() < 2) return;
    std::vector<std::vector<float>> two{{1, 2}, {3, 4}};
    std::vector<Span> pair{{two[0], {}}, {two[1], {}}};
    ddp::FullyShard swapped(comm, pair, {{0}, {1}});
    for (const std::size_t u : {std::size_t{0}, std::size_t{1}})
      swapped.forward(r == 0 ? u : 1 - u, [] {});
    try {
      swapped.step([](auto) {});
      MP_EXPECT(false, "units run in different orders were not noticed");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
    }
  });
}

TEST_CASE("Join: uneven inputs on backend::Mpi, averaged over the ranks that trained each step") {
  on_world([](Mpi& comm) {
    const int r = comm.rank(), p = comm.size();
    std::vector<Param> model;
    for (std::size_t n : {std::size_t{100000}, std::size_t{5}})
      model.push_back({std::vector<float>(n, 1.0f), std::vector<float>(n)});
    ddp::GradientAverager avg(comm, model);
    const auto steps = [](int rank) { return 2 + 2 * rank; };  // 2, 4, 6, 8: up to 4x
    ddp::Join join(comm, {&avg});
    for (int s = 0; s < steps(r); ++s) {
      const int active = join.step();
      int want = 0, sum = 0;
      for (int j = 0; j < p; ++j) {
        want += steps(j) > s;
        if (steps(j) > s) sum += j + 1;
      }
      MP_EXPECT(active == want, "step " << s << ": " << active);
      for (auto& prm : model)
        std::fill(prm.grad.begin(), prm.grad.end(), static_cast<float>(r + 1));
      avg.average();
      const float mean = static_cast<float>(sum) / static_cast<float>(active);
      for (auto& prm : model) {
        MP_EXPECT(prm.grad.front() == mean && prm.grad.back() == mean,
                  "step " << s << ": " << prm.grad.front() << ", expected " << mean);
        for (float& v : prm.value) v -= 0.25f * prm.grad.front();
      }
    }
    join.finish();
    MP_EXPECT(join.last() == p - 1, join.last());
    const auto all = comm.all_gather_object(static_cast<double>(model[0].value[7]));
    for (double v : all) MP_EXPECT(v == all[0], "ranks ended with different parameters");
  });
}

int main(int argc, char** argv) {
  cases::bitwise_floats = false;  // MPI chooses the order in which ranks are combined
  const std::string mode = ddp::detail::EnvReader().get("DDP_MPI_TEST_MODE");
  if (mode == "collective-timeout") {
    ddp::Options o;
    o.timeout = 500ms;
    auto comm = Mpi::init(ddp::Environment::detect(), o);
    std::vector<float> v(8, 1.0f);
    if (comm.rank() == 0) comm.all_reduce(v);  // the others never join
    std::this_thread::sleep_for(30s);          // the watchdog ends the job long before this
    return 3;
  }
  doctest::Context context(argc, argv);
  const int rc = context.run();
  int failed = rc, any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return any;
}
