// FullyShardedAverager across real processes: a model whose parameters live sharded, gathered a
// unit at a time, trains bitwise as GradientAverager does; units that differ between ranks, and
// calls out of turn, are refused. FullyShard: a model of a tensor type of one's own, its
// parameters re-pointed at the gathered units, the same.
#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/spawn.hpp>
#include <ddp/training/averaging/gradient.hpp>
#include <ddp/training/averaging/join.hpp>
#include <ddp/training/elastic/elastic.hpp>
#include <ddp/training/fully_sharded/fully_shard.hpp>
#include <ddp/training/fully_sharded/fully_sharded.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "multiprocess.hpp"

// A tensor type of one's own that FullyShard re-points: a pointer and a size, owning nothing.
namespace fully_shard_toy {
struct Tensor {
  float* data = nullptr;
  std::size_t size = 0;
};
struct Param {  // a framework's parameter: its value, its gradient, the memory it started with
  Tensor w, dw;
  std::vector<float> own;
};
}  // namespace fully_shard_toy

template <>
struct ddp::tensor_traits<fully_shard_toy::Tensor> {
  static constexpr ddp::DeviceKind device_kind = ddp::DeviceKind::cpu;
  static ddp::TensorView<float> view(fully_shard_toy::Tensor& t) { return {t.data, t.size}; }
  static ddp::TensorView<const float> view(const fully_shard_toy::Tensor& t) {
    return {t.data, t.size};
  }
};
template <>
struct ddp::parameter_traits<fully_shard_toy::Param> {
  static fully_shard_toy::Tensor& value(fully_shard_toy::Param& p) { return p.w; }
  static fully_shard_toy::Tensor& grad(fully_shard_toy::Param& p) { return p.dw; }
  // The hook FullyShard calls to point the parameter at a gathered unit (empty: at nothing).
  static void point(fully_shard_toy::Param& p, std::span<float> value, std::span<float> grad) {
    p.w = {value.data(), value.size()};
    p.dw = {grad.data(), grad.size()};
  }
};

// Named, so that the executable can be built as one unity translation unit.
namespace fully_sharded_tests {
namespace {

struct Param {
  std::vector<float> value, grad;
};

// Three units of uneven sizes (a parameter of one element, units smaller and larger than the
// world, blocks that cut parameters apart).
const std::vector<std::vector<std::size_t>> unit_sizes{{37, 1001}, {3, 129, 1}, {5002, 64}};

float initial(std::size_t unit, std::size_t param, std::size_t k) {
  return 0.5f * std::sin(0.3f * static_cast<float>(k) + static_cast<float>(7 * unit + param));
}

// The initializer: this rank's pieces of the initial values.
void init_values(std::size_t u, std::size_t i, std::size_t offset, std::span<float> values) {
  for (std::size_t k = 0; k < values.size(); ++k) values[k] = initial(u, i, offset + k);
}

// Rank r's gradient at step s of element k of parameter `param` of unit `unit`, given its value.
float gradient(std::size_t unit, std::size_t param, std::size_t k, float value, int rank,
               int step) {
  const float x = static_cast<float>(k) * 0.01f + static_cast<float>(3 * unit + param);
  const float target =
      std::cos(x + 0.7f * static_cast<float>(rank) + 0.3f * static_cast<float>(step));
  return (1.0f + 0.5f * std::sin(x)) * (value - target);
}

// SGD with momentum 0.9 (lr 0.05), or Adam (lr 0.01), over slices (value, grad, n) in order; its
// state is kept per element of the slices end to end (so that it can be checkpointed sharded).
struct Optimizer {
  bool adam = false;
  std::vector<float> m{}, v{};
  std::int64_t t = 0;
  template <class Slices>
  void step(Slices&& slices) {
    std::size_t j = 0;
    for (auto&& s : slices) j += s.value.size;
    m.resize(j, 0.0f);
    v.resize(adam ? j : 0, 0.0f);
    ++t;
    const auto c1 = static_cast<float>(1.0 - std::pow(0.9, static_cast<double>(t)));
    const auto c2 = static_cast<float>(1.0 - std::pow(0.999, static_cast<double>(t)));
    j = 0;
    for (auto&& s : slices) {
      float* x = s.value.data;
      const float* g = s.grad.data;
      for (std::size_t k = 0; k < s.value.size; ++k, ++j) {
        if (adam) {
          m[j] = 0.9f * m[j] + 0.1f * g[k];
          v[j] = 0.999f * v[j] + 0.001f * g[k] * g[k];
          x[k] -= 0.01f * (m[j] / c1) / (std::sqrt(v[j] / c2) + 1e-8f);
        } else {
          m[j] = 0.9f * m[j] + g[k];
          x[k] -= 0.05f * m[j];
        }
      }
    }
  }
  void put(ddp::Checkpoint& ck, const ddp::ShardLayout* layout) const {
    ck.put_object("t", t);
    for (const auto& [name, state] : {std::pair{"m", &m}, std::pair{"v", &v}}) {
      if (state->empty()) continue;
      if (layout != nullptr)
        ck.put_sharded(name, *state, *layout);
      else
        ck.put_values(name, *state);
    }
  }
  void get(const ddp::Checkpoint& ck, std::size_t elements) {
    t = ck.get_object<std::int64_t>("t");
    m.assign(elements, 0.0f);
    v.assign(adam ? elements : 0, 0.0f);
    ck.get_values("m", std::span(m));
    if (adam) ck.get_values("v", std::span(v));
  }
};

struct WholeParam {
  std::vector<float> value, grad;
};
struct WholeNet {
  std::vector<WholeParam> params;
  WholeNet() {
    for (std::size_t u = 0; u < unit_sizes.size(); ++u)
      for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
        WholeParam p{std::vector<float>(unit_sizes[u][i]), std::vector<float>(unit_sizes[u][i])};
        for (std::size_t k = 0; k < p.value.size(); ++k) p.value[k] = initial(u, i, k);
        params.push_back(std::move(p));
      }
  }
  std::vector<WholeParam>& parameters() { return params; }
  std::size_t elements() const {
    std::size_t n = 0;
    for (const auto& p : params) n += p.value.size();
    return n;
  }
};

struct Slice {  // a whole parameter as an optimizer's slice
  ddp::TensorView<float> value, grad;
};

// One step of the fully sharded model: the backward unit by unit (last first, the next one
// prefetched), then the optimizer on the shard.
// `reduced(u)` is called after unit u's reduce() is issued.
template <class Fsdp, class After = void (*)(std::size_t)>
void sharded_step(
    Fsdp& fsdp, Optimizer& opt, int rank, int step, After reduced = [](std::size_t) {}) {
  fsdp.prefetch(unit_sizes.size() - 1);
  for (std::size_t u = unit_sizes.size(); u-- > 0;) {
    const auto w = fsdp.gather(u);
    if (u > 0) fsdp.prefetch(u - 1);
    const auto g = fsdp.grad(u);
    using Grad = typename decltype(g)::value_type;  // added in float, rounded once
    std::size_t at = 0;
    for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
      for (std::size_t k = 0; k < unit_sizes[u][i]; ++k)
        g[at + k] = Grad(static_cast<float>(g[at + k]) +
                         gradient(u, i, k, static_cast<float>(w[at + k]), rank, step));
      at += unit_sizes[u][i];
    }
    fsdp.release(u);
    fsdp.reduce(u);
    reduced(u);
  }
  fsdp.synchronize();
  opt.step(fsdp.shard());
}

// The unsharded reference's gradients at `step` on `rank`, of its parameters as `seen` gives
// them to the backward (rounded to the gathered type, say).
template <class Seen>
void whole_gradients(WholeNet& whole, int rank, int step, Seen seen) {
  std::size_t first = 0;
  for (std::size_t u = 0; u < unit_sizes.size(); ++u) {
    for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
      auto& p = whole.params[first + i];
      for (std::size_t k = 0; k < p.value.size(); ++k)
        p.grad[k] = gradient(u, i, k, seen(p.value[k]), rank, step);
    }
    first += unit_sizes[u].size();
  }
}

// The unsharded reference's optimizer step over its averaged gradients.
void whole_update(WholeNet& whole, Optimizer& opt) {
  std::vector<Slice> slices;
  for (auto& p : whole.params)
    slices.push_back({{p.value.data(), p.value.size()}, {p.grad.data(), p.grad.size()}});
  opt.step(slices);
}

// Every unit gathered, end to end, as bytes (collective).
template <class Fsdp>
std::string model_bytes(Fsdp& fsdp) {
  std::string out;
  for (std::size_t u = 0; u < fsdp.units(); ++u) {
    const std::span<float> w = fsdp.gather(u);
    out.append(reinterpret_cast<const char*>(w.data()), w.size_bytes());
    fsdp.release(u);
  }
  return out;
}

// Part of a run: steps [from, to) of SGD-momentum or Adam, both ways: every parameter whole,
// averaged by GradientAverager (the reference), and fully sharded. From a step past 0 both are
// loaded from `dir` (the reference from rank 0's file, the sharded model from its set, saved at
// any world size); with a `dir`, both are saved there at the end. The parameters must end
// bitwise equal (across hosts too: the reduce_scatter adds in the hierarchical all_reduce's
// order).
struct Phase {
  bool adam = false;
  int from = 0, to = 20;
  std::string dir{};
};

void train_against_gradient_averager(mp::Comm& comm, const Phase& ph) {
  WholeNet whole;
  ddp::GradientAverager avg(comm, whole);
  Optimizer whole_opt{ph.adam};
  // Fully sharded: this rank keeps its blocks only, made by the initializer.
  ddp::FullyShardedAverager fsdp(comm, unit_sizes, init_values);
  Optimizer opt{ph.adam};
  if (ph.from > 0) {
    const auto ck = ddp::Checkpoint::load(ph.dir + "/whole");
    MP_EXPECT(ck.has_value(), "no reference checkpoint");
    for (std::size_t i = 0; i < whole.params.size(); ++i)
      ck->get_values("p" + std::to_string(i), std::span(whole.params[i].value));
    whole_opt.get(*ck, whole.elements());
    const auto sharded = fsdp.load(ph.dir + "/sharded");
    MP_EXPECT(sharded.has_value(), "no sharded checkpoint");
    MP_EXPECT(sharded->get_object<int>("step") == ph.from, "saved at another step");
    opt.get(*sharded, fsdp.layout().elements());
  }
  for (int step = ph.from; step < ph.to; ++step) {
    whole_gradients(whole, comm.rank(), step, [](float x) { return x; });
    avg.average();
    whole_update(whole, whole_opt);

    sharded_step(fsdp, opt, comm.rank(), step);
    if (step % 3 == 1) fsdp.trim();  // the kept buffers go; the next step maps new ones
  }
  const auto differs = [&](std::span<const float> got, const std::vector<float>& want) {
    double worst = 0;
    for (std::size_t k = 0; k < want.size(); ++k)
      worst = std::max(worst, std::abs(static_cast<double>(got[k]) - want[k]) /
                                  std::max(1.0, std::abs(static_cast<double>(want[k]))));
    const bool same = std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0;
    char text[48];
    std::snprintf(text, sizeof text, "%.3g (relative)", worst);
    return same ? std::string() : std::string(text);
  };
  // Every unit gathered: bitwise the reference's parameters, on every rank.
  std::size_t first = 0;
  for (std::size_t u = 0; u < unit_sizes.size(); ++u) {
    const std::span<float> w = fsdp.gather(u);
    std::size_t at = 0;
    for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
      const auto& p = whole.params[first + i].value;
      const std::string d = differs(w.subspan(at, p.size()), p);
      MP_EXPECT(d.empty(),
                "unit " << u << " parameter " << i << " differs from GradientAverager's by " << d);
      at += p.size();
    }
    fsdp.release(u);
    first += unit_sizes[u].size();
  }
  // The whole model at the last rank, a unit at a time: the same, in order.
  std::size_t seen = 0;
  const int root = comm.size() - 1;
  fsdp.gather_to(root, [&](std::size_t u, std::size_t i, std::span<const float> values) {
    std::size_t index = i;
    for (std::size_t v = 0; v < u; ++v) index += unit_sizes[v].size();
    MP_EXPECT(index == seen++, "gather_to out of order at unit " << u << " parameter " << i);
    const std::string d = differs(values, whole.params[index].value);
    MP_EXPECT(d.empty(), "gather_to: unit " << u << " parameter " << i << " differs by " << d);
  });
  MP_EXPECT(seen == (comm.rank() == root ? whole.params.size() : 0), seen);
  if (!ph.dir.empty()) {
    if (comm.rank() == 0) {
      std::string bytes;
      for (const auto& p : whole.params)
        bytes.append(reinterpret_cast<const char*>(p.value.data()), p.value.size() * sizeof(float));
      mp::TempDir::write(ph.dir + "/final", bytes);
      ddp::Checkpoint ck;
      for (std::size_t i = 0; i < whole.params.size(); ++i)
        ck.put_values("p" + std::to_string(i), whole.params[i].value);
      whole_opt.put(ck, nullptr);
      ck.save(ph.dir + "/whole");
    }
    ddp::Checkpoint state;
    state.put_object("step", ph.to);
    const ddp::ShardLayout layout = fsdp.layout();
    opt.put(state, &layout);
    fsdp.save(state, ph.dir + "/sharded");
  }
  // The shard: about 1/P of the model, its layout covering every element once over the ranks.
  std::size_t total = 0;
  for (const auto& u : unit_sizes)
    for (const std::size_t n : u) total += n;
  const auto p = static_cast<std::size_t>(comm.size());
  MP_EXPECT(fsdp.shard_size() <= total / p + unit_sizes.size(), fsdp.shard_size());
  const std::vector<std::uint64_t> mine{fsdp.layout().elements()};
  std::uint64_t covered = 0;
  for (const auto& n : comm.all_gather_object(mine)) covered += n[0];
  MP_EXPECT(covered == total, covered << " of " << total << " elements in the shards");
}

}  // namespace

TEST_CASE(
    "fully sharded: 20 steps of SGD-momentum and of Adam are bitwise GradientAverager's, "
    "worlds 1-4") {
  for (const bool adam : {false, true}) {
    CAPTURE(adam);
    mp::each_world_on(
        {ddp::HostTransport::shm, ddp::HostTransport::tcp, mp::two_hosts},
        [&](mp::Comm& comm) { train_against_gradient_averager(comm, {.adam = adam}); });
  }
}

namespace {
// Mixed precision: parameters gathered (and the backward computed) in ParamT, gradients written
// and averaged in ReduceT, float masters. The reference: float parameters whose backward sees
// them rounded to ParamT, its gradients rounded to ReduceT and averaged by one all_reduce in
// ReduceT. Bitwise, masters and gathered parameters alike.
template <class ParamT, class ReduceT>
void train_mixed(mp::Comm& comm) {
  WholeNet whole;
  Optimizer whole_opt;
  ddp::FullyShardedAverager<ddp::backend::Host, float, ParamT, ReduceT> fsdp(comm, unit_sizes,
                                                                             init_values);
  Optimizer opt;
  for (int step = 0; step < 10; ++step) {
    whole_gradients(whole, comm.rank(), step,
                    [](float x) { return static_cast<float>(ParamT(x)); });
    std::vector<ReduceT> all;
    for (const auto& p : whole.params)
      for (const float g : p.grad) all.push_back(ReduceT(g));
    comm.all_reduce(all, ddp::ReduceOp::avg);
    std::size_t j = 0;
    for (auto& p : whole.params)
      for (float& g : p.grad) g = static_cast<float>(all[j++]);
    whole_update(whole, whole_opt);
    sharded_step(fsdp, opt, comm.rank(), step);
  }
  std::size_t index = 0;
  fsdp.gather_to(0, [&](std::size_t u, std::size_t i, std::span<const float> values) {
    const auto& want = whole.params[index++].value;
    MP_EXPECT(std::memcmp(values.data(), want.data(), want.size() * sizeof(float)) == 0,
              "unit " << u << " parameter " << i << ": the masters differ");
  });
  std::size_t first = 0;
  for (std::size_t u = 0; u < unit_sizes.size(); ++u) {
    const std::span<ParamT> w = fsdp.gather(u);
    std::size_t at = 0;
    for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
      const auto& want = whole.params[first + i].value;
      for (std::size_t k = 0; k < want.size(); ++k)
        MP_EXPECT(std::memcmp(&w[at + k], &static_cast<const ParamT&>(ParamT(want[k])),
                              sizeof(ParamT)) == 0,
                  "unit " << u << " parameter " << i << " element " << k << " gathered as "
                          << static_cast<float>(w[at + k]) << ", not " << want[k] << " rounded");
      at += want.size();
    }
    fsdp.release(u);
    first += unit_sizes[u].size();
  }
}
}  // namespace

TEST_CASE(
    "fully sharded: mixed precision (parameters gathered and gradients averaged in "
    "bfloat16, half or float, float masters) is bitwise the rounded unsharded run") {
  mp::each_world_on({ddp::HostTransport::shm}, [](mp::Comm& comm) {
    train_mixed<ddp::bfloat16, float>(comm);
    train_mixed<ddp::half, float>(comm);
    train_mixed<ddp::bfloat16, ddp::bfloat16>(comm);
    train_mixed<float, ddp::half>(comm);
  });
}

TEST_CASE(
    "fully sharded: a run resumed from a sharded checkpoint at another world size goes on "
    "bitwise as GradientAverager's") {
  for (const auto& worlds : {std::pair{3, 2}, std::pair{2, 4}}) {
    const int before = worlds.first, after = worlds.second;  // (clang 14: no binding captures)
    for (const bool adam : {false, true}) {
      CAPTURE(before);
      CAPTURE(after);
      CAPTURE(adam);
      mp::TempDir dir;
      mp::run(before, ddp::HostTransport::shm, [&](mp::Comm& comm) {
        train_against_gradient_averager(comm, {.adam = adam, .from = 0, .to = 10, .dir = dir.path});
      });
      mp::run(after, ddp::HostTransport::shm, [&](mp::Comm& comm) {
        train_against_gradient_averager(comm,
                                        {.adam = adam, .from = 10, .to = 20, .dir = dir.path});
      });
    }
  }
  // Nothing saved: nothing loaded, the shard untouched; another model's set refused by name.
  mp::TempDir dir;
  mp::run(2, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    ddp::FullyShardedAverager<ddp::backend::Host> fsdp(comm, unit_sizes, nullptr);
    MP_EXPECT(!fsdp.load(dir.file("none")).has_value(), "a set loaded where none was saved");
    fsdp.save(dir.file("run"));
    auto other = unit_sizes;
    other[2][0] += 1;
    ddp::FullyShardedAverager<ddp::backend::Host> wrong(comm, other, nullptr);
    try {
      (void)wrong.load(dir.file("run"));
      MP_EXPECT(false, "another model's checkpoint was loaded");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                    std::string(e.what()).find("FullyShardedAverager::load") != std::string::npos &&
                    std::string(e.what()).find("saved with another model") != std::string::npos,
                e.what());
    }
  });
}

namespace {
// The reference for a rank of 4 lost at step 8: 4 ranks to step 8 (GradientAverager, checked
// against the sharded run), then 3 from its checkpoint to step 12 (Adam): the model's bytes.
std::string lost_rank_reference(const mp::TempDir& dir) {
  mp::run(4, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    train_against_gradient_averager(comm, {.adam = true, .from = 0, .to = 8, .dir = dir.path});
  });
  mp::run(3, ddp::HostTransport::shm, [&](mp::Comm& comm) {
    train_against_gradient_averager(comm, {.adam = true, .from = 8, .to = 12, .dir = dir.path});
  });
  return mp::TempDir::read(dir.file("final"));
}
}  // namespace

TEST_CASE(
    "fully sharded: a lost rank's shard comes back from the in-memory copy on the rank "
    "before it, no step lost, whether it died between steps or inside a backward's "
    "all_gather and reduce_scatter") {
  mp::TempDir dir;
  const std::string want = lost_rank_reference(dir);
  REQUIRE(!want.empty());
  // Rank 2 of 4 dies at the start of step 8, or in its backward once the last unit's
  // reduce_scatter and the next unit's all_gather are on their way; each step was saved to the
  // mirror.
  for (const bool inside : {false, true}) {
    CAPTURE(inside);
    mp::run_with_losses([&](mp::Comm& comm, int first) {
      ddp::ShardMirror mirror;
      std::optional<ddp::FullyShardedAverager<ddp::backend::Host>> fsdp;
      fsdp.emplace(comm, unit_sizes, init_values);
      Optimizer opt;
      opt.adam = true;
      int step = 0, resumed = -1;
      for (;;) {
        try {
          for (; step < 12; ++step) {
            const bool victim = first == 2 && step == 8 && comm.epoch() == 0;
            if (victim && !inside) std::_Exit(5);
            sharded_step(*fsdp, opt, comm.rank(), step, [&](std::size_t u) {
              if (victim && u + 1 == unit_sizes.size()) std::_Exit(5);
            });
            ddp::Checkpoint state;
            state.put_object("step", step + 1);
            const ddp::ShardLayout layout = fsdp->layout();
            opt.put(state, &layout);
            fsdp->save(state, mirror, static_cast<std::uint64_t>(step + 1));
          }
          break;
        } catch (const ddp::Error& e) {
          MP_EXPECT(e.code() == ddp::Errc::peer_lost || e.code() == ddp::Errc::aborted, e.what());
          fsdp.reset();
          comm = comm.shrink({.wait_for_ranks = std::chrono::seconds(10)});
          fsdp.emplace(comm, unit_sizes, nullptr);  // shards for the survivors
          const auto ck = fsdp->load(mirror);
          MP_EXPECT(ck.has_value(), "no save in memory to resume from");
          step = resumed = ck->get_object<int>("step");
          opt.get(*ck, fsdp->layout().elements());
        }
      }
      MP_EXPECT(resumed == 8, "resumed after " << resumed << " steps, not 8");
      const std::string got = model_bytes(*fsdp);
      mp::TempDir::write(dir.file("net" + std::to_string(first)), got);
    });
    for (const int r : {0, 1, 3}) {
      CHECK_MESSAGE(mp::TempDir::read(dir.file("net" + std::to_string(r))) == want,
                    "survivor " << r << " differs from the reference");
      std::remove(dir.file("net" + std::to_string(r)).c_str());
    }
  }
}

TEST_CASE("fully sharded: uneven inputs in a ddp::Join train bitwise as GradientAverager's") {
  // Rank r trains 3 + 2r steps (SGD-momentum, the same model both ways, both in one Join); a
  // finished rank takes part in the others' gathers and reduces and updates its shard.
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    WholeNet whole;
    ddp::GradientAverager avg(comm, whole);
    Optimizer whole_opt;
    ddp::FullyShardedAverager fsdp(comm, unit_sizes, init_values);
    Optimizer opt;
    fsdp.on_join_step([&](auto shard) { opt.step(shard); });
    const int mine = 3 + 2 * comm.rank();
    {
      ddp::Join join(comm, {&avg, &fsdp});
      for (int step = 0; step < mine; ++step) {
        join.step();
        whole_gradients(whole, comm.rank(), step, [](float x) { return x; });
        avg.average();
        whole_update(whole, whole_opt);
        sharded_step(fsdp, opt, comm.rank(), step);
      }
      join.finish();
      MP_EXPECT(join.shadowed() == static_cast<std::size_t>(7 - mine), join.shadowed());
    }
    std::size_t index = 0;
    fsdp.gather_to(0, [&](std::size_t u, std::size_t i, std::span<const float> values) {
      const auto& want = whole.params[index++].value;
      MP_EXPECT(std::memcmp(values.data(), want.data(), want.size() * sizeof(float)) == 0,
                "unit " << u << " parameter " << i << " differs from GradientAverager's");
    });
  });
  // Without the update a finished rank runs, the Join is refused on every rank.
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    ddp::FullyShardedAverager fsdp(comm, unit_sizes, init_values);
    mp::expect_invalid("call on_join_step(update) first", [&] { ddp::Join join(comm, {&fsdp}); });
  });
}

TEST_CASE(
    "fully sharded: units of one size gathered in different orders fail the step's check, and "
    "gradients taken but not reduced are reduced at synchronize") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    const auto ones = [](std::size_t u, std::size_t, std::size_t, std::span<float> v) {
      std::fill(v.begin(), v.end(), static_cast<float>(u));
    };
    ddp::FullyShardedAverager fsdp(comm, {{4}, {4}}, ones);
    const std::size_t first = comm.rank() == 1 ? 1 : 0;
    for (const std::size_t u : {first, 1 - first}) {
      (void)fsdp.gather(u);
      fsdp.release(u);
    }
    try {
      fsdp.synchronize();
      MP_EXPECT(false, "units gathered in different orders were not noticed");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                    std::string(e.what()).find("different orders this step") != std::string::npos,
                e.what());
      MP_EXPECT(std::string(e.what()).find("; rank 0 ran gather 0, gather 1; rank 1 ran gather 1, "
                                           "gather 0; rank 2 ran gather 0, gather 1.") !=
                    std::string::npos,
                e.what());
    }
    // The next step starts afresh: in one order, it passes; unit 0's gradients (rank + 1 each)
    // were taken and never reduced: synchronize() reduces them, the average is 2.
    for (const std::size_t u : {std::size_t{0}, std::size_t{1}}) {
      (void)fsdp.gather(u);
      fsdp.release(u);
    }
    for (float& g : fsdp.grad(0)) g = static_cast<float>(comm.rank() + 1);
    // Unit 1 reduced, then its grad() asked for again (the next backward's zeros): the
    // averages stay. Unit 0 prefetched for the next step: released at synchronize(), so the
    // update below is what the next gather sees.
    for (float& g : fsdp.grad(1)) g = static_cast<float>(2 * comm.rank() + 2);
    fsdp.reduce(1);
    (void)fsdp.grad(1);
    fsdp.prefetch(0);
    fsdp.synchronize();
    for (const auto& s : fsdp.shard())
      for (std::size_t k = 0; k < s.grad.size; ++k) {
        MP_EXPECT(s.grad.data[k] == (s.param == 0 ? 2.0f : 4.0f),
                  "parameter " << s.param << ": " << s.grad.data[k]);
        s.value.data[k] += 10.0f;
      }
    const auto fresh = fsdp.gather(0);
    MP_EXPECT(std::all_of(fresh.begin(), fresh.end(), [](float x) { return x == 10.0f; }),
              "a unit gathered before the update came back stale: " << fresh[0]);
    fsdp.release(0);
    fsdp.synchronize();
    // Without the check (check_order = false) the mixed-up order goes unnoticed.
    ddp::FullyShardedOptions unchecked;
    unchecked.check_order = false;
    ddp::FullyShardedAverager loose(comm, {{4}, {4}}, ones, unchecked);
    for (const std::size_t u : {first, 1 - first}) {
      (void)loose.gather(u);
      loose.release(u);
    }
    loose.synchronize();
    // The check is a collective: ranks that choose differently are refused when made.
    ddp::FullyShardedOptions mixed;
    mixed.check_order = comm.rank() != 2;
    try {
      ddp::FullyShardedAverager differing(comm, {{4}, {4}}, ones, mixed);
      MP_EXPECT(false, "ranks differing in check_order were accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                    std::string(e.what()).find("check_order is true on rank 0 but false on "
                                               "rank 2") != std::string::npos,
                e.what());
    }
  });
}

TEST_CASE("fully sharded: units that differ between ranks, and calls out of turn, are refused") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    auto units = unit_sizes;
    if (comm.rank() == 2) units[1][1] = 130;
    try {
      ddp::FullyShardedAverager fsdp(comm, units, nullptr);
      MP_EXPECT(false, "units that differ were accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                    std::string(e.what()).find("rank 2's units differ from rank 0's") !=
                        std::string::npos,
                e.what());
    }
    ddp::FullyShardedAverager<ddp::backend::Host> fsdp(comm, unit_sizes, nullptr);
    const auto refused = [](const std::string& needle, auto&& call) {
      mp::expect_invalid(needle, call);
    };
    refused("unit 3 of 3", [&] { (void)fsdp.gather(3); });
    refused("unit 1 is reduced without gradients", [&] { fsdp.reduce(1); });
    (void)fsdp.grad(1);
    fsdp.reduce(1);
    refused("unit 1 is reduced twice", [&] { fsdp.reduce(1); });
    const auto fresh = fsdp.grad(1);  // the reduce waited for, a new backward's zeros
    MP_EXPECT(std::all_of(fresh.begin(), fresh.end(), [](float g) { return g == 0.0f; }),
              "a new backward's gradients are not zero");
    fsdp.synchronize();
    // The shard from rank 2's whole model: every parameter k's elements k + 1000 * (unit,
    // param), which gather_to hands back.
    refused("scatter_from: root 3 outside the world of 3",
            [&] { fsdp.scatter_from(3, [](std::size_t, std::size_t, std::span<float>) {}); });
    const auto fill = [](std::size_t u, std::size_t i, std::span<float> values) {
      for (std::size_t k = 0; k < values.size(); ++k)
        values[k] = static_cast<float>(k + 1000 * (10 * u + i));
    };
    fsdp.scatter_from(2, [&](std::size_t u, std::size_t i, std::span<float> values) {
      MP_EXPECT(comm.rank() == 2, "scatter_from called fn on rank " << comm.rank());
      MP_EXPECT(values.size() == unit_sizes[u][i], values.size());
      fill(u, i, values);
    });
    fsdp.gather_to(0, [&](std::size_t u, std::size_t i, std::span<const float> values) {
      std::vector<float> want(unit_sizes[u][i]);
      fill(u, i, want);
      MP_EXPECT(std::equal(values.begin(), values.end(), want.begin(), want.end()),
                "scatter_from: unit " << u << " parameter " << i << " came back otherwise");
    });
    refused("unit 0 has no elements",
            [&] { ddp::FullyShardedAverager<ddp::backend::Host> empty(comm, {{}}, nullptr); });
    // Sizes past what memory can address (a wrapped sum, or one beyond any byte count): named
    // before anything is allocated, never a short buffer.
    const std::size_t huge = std::size_t{1} << 62;
    for (const auto& huge_units : std::vector<std::vector<std::vector<std::size_t>>>{
             {{huge, huge, huge, huge + 1}}, {{8}, {huge + 1}}})
      refused("more elements than memory can address", [&] {
        ddp::FullyShardedAverager<ddp::backend::Host> big(comm, huge_units, nullptr);
      });
#if !DDP_HAS_CUDA
    // Units on a device in a build without CUDA: named, on every rank, before any allocation.
    try {
      ddp::FullyShardedOptions gpu;
      gpu.device = ddp::Device::cuda(0);
      ddp::FullyShardedAverager<ddp::backend::Host> on_gpu(comm, {{8}}, nullptr, gpu);
      MP_EXPECT(false, "units on cuda:0 accepted without CUDA");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::unsupported &&
                    std::string(e.what()).find("built without CUDA") != std::string::npos,
                e.what());
    }
#endif
  });
}

namespace {

// A model of the toy type: unit_sizes' parameters in order, rank 0's values the initial ones
// (the others' differ: FullyShard takes rank 0's), or none at all (`empty`: pointing at nothing,
// sizes only, for the initializer).
std::vector<fully_shard_toy::Param> toy_model(int rank, bool empty) {
  std::vector<fully_shard_toy::Param> net;
  for (std::size_t u = 0; u < unit_sizes.size(); ++u)
    for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
      fully_shard_toy::Param p;
      if (!empty) {
        p.own.resize(unit_sizes[u][i]);
        for (std::size_t k = 0; k < p.own.size(); ++k)
          p.own[k] = rank == 0 ? initial(u, i, k) : -1.0f;
      }
      p.w = {p.own.data(), unit_sizes[u][i]};
      net.push_back(std::move(p));
    }
  return net;
}

// unit_sizes' units as lists of the toy model's parameter indices.
std::vector<std::vector<std::size_t>> toy_units() {
  std::vector<std::vector<std::size_t>> units;
  for (std::size_t u = 0, i = 0; u < unit_sizes.size(); ++u) {
    units.emplace_back();
    for (std::size_t j = 0; j < unit_sizes[u].size(); ++j) units.back().push_back(i++);
  }
  return units;
}

// One step of the toy model through FullyShard: the forward, the backward adding gradient()
// (`done(u)` after unit u's), the optimizer on the shard.
template <class Shard, class Done = void (*)(std::size_t)>
void toy_step(
    Shard& fsdp, std::vector<fully_shard_toy::Param>& net, Optimizer& opt, int rank, int step,
    Done done = [](std::size_t) {}) {
  const std::size_t units = fsdp.units();
  for (std::size_t u = 0; u < units; ++u) fsdp.forward(u, [] {});
  for (std::size_t u = units; u-- > 0;) {
    fsdp.backward(u, [&] {
      const auto& ids = fsdp.unit_parameters(u);
      for (std::size_t j = 0; j < ids.size(); ++j) {
        auto& p = net[ids[j]];
        for (std::size_t k = 0; k < p.w.size; ++k)
          p.dw.data[k] += gradient(u, j, k, p.w.data[k], rank, step);
      }
    });
    done(u);
  }
  fsdp.step([&](auto shard) { opt.step(shard); });
}

struct ShardRun {
  bool adam = false, init = false, reshard = true, prefetch = true;
};

// 20 steps through FullyShard over the toy model against GradientAverager: inside each unit's
// forward and backward its parameters hold the reference's current values, bitwise; between
// units they point at nothing; the gradients the backward adds train the same bits.
void train_toy(mp::Comm& comm, const ShardRun& run) {
  WholeNet whole;
  ddp::GradientAverager avg(comm, whole);
  Optimizer whole_opt{run.adam}, opt{run.adam};
  auto net = toy_model(comm.rank(), run.init);
  const auto units = toy_units();
  const ddp::FullyShardOptions o{.reshard_after_forward = run.reshard, .prefetch = run.prefetch};
  std::optional<ddp::FullyShard<std::vector<fully_shard_toy::Param>, ddp::backend::Host>> made;
  if (run.init) {
    made.emplace(
        comm, net, units,
        [&](std::size_t param, std::size_t offset, std::span<float> values) {
          std::size_t u = 0, i = param;
          while (i >= unit_sizes[u].size()) i -= unit_sizes[u++].size();
          init_values(u, i, offset, values);
        },
        o);
  } else {
    made.emplace(comm, net, units, o);
  }
  auto& fsdp = *made;
  for (auto& p : net) p.own = {};  // the model's own memory: no longer used
  const auto nothing = [&](const char* when) {
    for (std::size_t i = 0; i < net.size(); ++i)
      MP_EXPECT(net[i].w.size == 0 && net[i].dw.size == 0,
                "parameter " << i << " points at elements " << when);
  };
  nothing("after construction");
  // Unit u's parameters as the reference has them (and gradients of their size, when asked).
  const auto same = [&](std::size_t u, bool grads, const char* when) {
    for (std::size_t i : units[u]) {
      const auto& want = whole.params[i].value;
      MP_EXPECT(net[i].w.size == want.size() &&
                    std::memcmp(net[i].w.data, want.data(), want.size() * sizeof(float)) == 0,
                "parameter " << i << " of unit " << u << " differs from the reference " << when);
      MP_EXPECT(net[i].dw.size == (grads ? want.size() : 0),
                "parameter " << i << "'s gradient has " << net[i].dw.size << " elements " << when);
    }
  };
  for (int step = 0; step < 20; ++step) {
    for (std::size_t u = 0; u < units.size(); ++u) {
      const int got = fsdp.forward(u, [&] {
        same(u, false, "in its forward");
        return static_cast<int>(u);
      });
      MP_EXPECT(got == static_cast<int>(u), "forward returned " << got);
    }
    if (run.reshard) nothing("between the forward and the backward");
    for (std::size_t u = units.size(); u-- > 0;) {
      fsdp.backward(u, [&] {
        same(u, true, "in its backward");
        for (std::size_t j = 0; j < units[u].size(); ++j) {
          auto& p = net[units[u][j]];
          for (std::size_t k = 0; k < p.w.size; ++k)
            p.dw.data[k] += gradient(u, j, k, p.w.data[k], comm.rank(), step);
        }
      });
    }
    fsdp.step([&](auto shard) { opt.step(shard); });
    nothing("after step()");
    whole_gradients(whole, comm.rank(), step, [](float x) { return x; });
    avg.average();
    whole_update(whole, whole_opt);
  }
  std::size_t index = 0;
  fsdp.averager().gather_to(0, [&](std::size_t u, std::size_t i, std::span<const float> values) {
    const auto& want = whole.params[index++].value;
    MP_EXPECT(std::memcmp(values.data(), want.data(), want.size() * sizeof(float)) == 0,
              "unit " << u << " parameter " << i << " differs from GradientAverager's");
  });
}

// A model whose parameters are spans: re-pointed by assignment, no hook needed.
struct SpanParam {
  std::span<float> value, grad;
};

}  // namespace

TEST_CASE(
    "FullyShard in a ddp::Join: uneven inputs train bitwise as GradientAverager's, the order "
    "check on, the finished ranks answering it") {
  // Rank r trains 3 + 2r steps through FullyShard; its engine is the Joinable.
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    WholeNet whole;
    ddp::GradientAverager avg(comm, whole);
    Optimizer whole_opt, opt;
    auto net = toy_model(comm.rank(), false);
    ddp::FullyShard fsdp(comm, net, toy_units());
    fsdp.averager().on_join_step([&](auto shard) { opt.step(shard); });
    const int mine = 3 + 2 * comm.rank();
    {
      ddp::Join join(comm, {&avg, &fsdp.averager()});
      for (int step = 0; step < mine; ++step) {
        join.step();
        whole_gradients(whole, comm.rank(), step, [](float x) { return x; });
        avg.average();
        whole_update(whole, whole_opt);
        toy_step(fsdp, net, opt, comm.rank(), step);
      }
      join.finish();
      MP_EXPECT(join.shadowed() == static_cast<std::size_t>(7 - mine), join.shadowed());
    }
    std::size_t index = 0;
    fsdp.averager().gather_to(0, [&](std::size_t u, std::size_t i, std::span<const float> values) {
      const auto& want = whole.params[index++].value;
      MP_EXPECT(std::memcmp(values.data(), want.data(), want.size() * sizeof(float)) == 0,
                "unit " << u << " parameter " << i << " differs from GradientAverager's");
    });
  });
}

TEST_CASE(
    "FullyShard: a model of a tensor type of one's own, re-pointed at each unit, trains 20 "
    "steps of SGD-momentum and of Adam bitwise as GradientAverager's, worlds 1-4 and two hosts") {
  for (const bool adam : {false, true}) {
    CAPTURE(adam);
    mp::each_world_on({ddp::HostTransport::shm, ddp::HostTransport::tcp, mp::two_hosts},
                      [&](mp::Comm& comm) { train_toy(comm, {.adam = adam}); });
  }
  // Made from an initializer (no rank holds the model), units kept from the forward to the
  // backward, prefetch off: the same bits.
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    train_toy(comm, {.adam = true, .init = true});
    train_toy(comm, {.reshard = false});
    train_toy(comm, {.prefetch = false});
  });
}

namespace {
struct HalfParam {  // a bfloat16 model
  std::span<ddp::bfloat16> value, grad;
};
}  // namespace

TEST_CASE(
    "FullyShard: a bfloat16 model with float masters trains bitwise as FullyShardedAverager<"
    "float, bfloat16, bfloat16>") {
  mp::run(3, ddp::HostTransport::shm, [](mp::Comm& comm) {
    using B = ddp::bfloat16;
    // The engine, its masters the initial values rounded to bfloat16.
    ddp::FullyShardedAverager<ddp::backend::Host, float, B, B> engine(
        comm, unit_sizes, [](std::size_t u, std::size_t i, std::size_t offset, std::span<float> v) {
          for (std::size_t k = 0; k < v.size(); ++k)
            v[k] = static_cast<float>(B(initial(u, i, offset + k)));
        });
    // The model: rank 0's bfloat16 values.
    std::vector<std::vector<B>> memory;
    std::vector<HalfParam> net;
    for (std::size_t u = 0; u < unit_sizes.size(); ++u)
      for (std::size_t i = 0; i < unit_sizes[u].size(); ++i) {
        memory.emplace_back(unit_sizes[u][i]);
        for (std::size_t k = 0; k < memory.back().size(); ++k)
          memory.back()[k] = B(comm.rank() == 0 ? initial(u, i, k) : 0.0f);
      }
    for (auto& m : memory) net.push_back({m, {}});
    ddp::FullyShard<std::vector<HalfParam>, ddp::backend::Host, B, float> fsdp(comm, net,
                                                                               toy_units());
    static_assert(std::is_same_v<decltype(fsdp.shard())::value_type, ddp::ShardSlice<float>>);
    Optimizer opt_engine{true}, opt{true};
    for (int step = 0; step < 10; ++step) {
      sharded_step(engine, opt_engine, comm.rank(), step);
      for (std::size_t u = 0; u < fsdp.units(); ++u) fsdp.forward(u, [] {});
      for (std::size_t u = fsdp.units(); u-- > 0;)
        fsdp.backward(u, [&] {
          const auto& ids = fsdp.unit_parameters(u);
          for (std::size_t j = 0; j < ids.size(); ++j) {
            auto& p = net[ids[j]];
            for (std::size_t k = 0; k < p.value.size(); ++k)
              p.grad[k] = B(static_cast<float>(p.grad[k]) +
                            gradient(u, j, k, static_cast<float>(p.value[k]), comm.rank(), step));
          }
        });
      fsdp.step([&](auto shard) { opt.step(shard); });
    }
    std::vector<std::string> want;
    engine.gather_to(0, [&](std::size_t, std::size_t, std::span<const float> v) {
      want.emplace_back(reinterpret_cast<const char*>(v.data()), v.size_bytes());
    });
    std::size_t index = 0;
    fsdp.averager().gather_to(0, [&](std::size_t u, std::size_t i, std::span<const float> v) {
      MP_EXPECT(
          want[index++] == std::string(reinterpret_cast<const char*>(v.data()), v.size_bytes()),
          "unit " << u << " parameter " << i << ": the masters differ from the engine's");
    });
    MP_EXPECT(index == want.size(), index);
  });
}

TEST_CASE("FullyShard: parameters of spans, units listed out of order and a unit unused") {
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    std::vector<std::vector<float>> memory{{1, 2, 3}, {4, 5}, {6, 7, 8, 9}};
    std::vector<SpanParam> net;
    for (auto& m : memory) net.push_back({m, {}});
    if (comm.rank() == 1)
      for (auto& m : memory) std::fill(m.begin(), m.end(), 0.0f);
    ddp::FullyShard fsdp(comm, net, {{2, 0}, {1}});
    for (int step = 0; step < 2; ++step) {
      fsdp.forward(0, [&] {
        MP_EXPECT(net[2].value.size() == 4 && net[2].value[0] == static_cast<float>(6 - step) &&
                      net[0].value.size() == 3 && net[0].value[2] == static_cast<float>(3 - step) &&
                      net[1].value.empty(),
                  "unit 0 is not parameters 2 and 0 at step " << step);
      });
      fsdp.backward(0, [&] {
        for (const std::size_t i : {std::size_t{0}, std::size_t{2}})
          for (float& g : net[i].grad) g += 1.0f;
      });
      // Unit 1 did not run: reduced with zeros, so its shard's gradients are 0.
      fsdp.step([&](auto shard) {
        for (auto& s : shard)
          for (std::size_t k = 0; k < s.value.size; ++k) s.value.data[k] -= s.grad.data[k];
      });
    }
    // The shard changed between steps (not through step()): the next forward sees it.
    for (auto& slice : fsdp.shard())
      for (std::size_t k = 0; k < slice.value.size; ++k) slice.value.data[k] *= 2.0f;
    fsdp.forward(0, [&] {
      MP_EXPECT(net[2].value[0] == 8.0f && net[0].value[0] == -2.0f,
                "the forward after the shard changed sees " << net[2].value[0] << ", "
                                                            << net[0].value[0]);
    });
    fsdp.backward(0, [] {});
    fsdp.step([&](auto shard) {
      for (auto& slice : shard)
        for (std::size_t k = 0; k < slice.value.size; ++k) slice.value.data[k] *= 0.5f;
    });
    std::vector<std::vector<float>> got(3);
    fsdp.averager().gather_to(0, [&](std::size_t u, std::size_t i, std::span<const float> v) {
      got[fsdp.unit_parameters(u)[i]].assign(v.begin(), v.end());
    });
    if (comm.rank() == 0)
      MP_EXPECT((got == std::vector<std::vector<float>>{{-1, 0, 1}, {4, 5}, {4, 5, 6, 7}}),
                "the model after two steps is not the expected one");
  });
}

TEST_CASE("FullyShard: units listed wrong, run twice, or parameters pointed away are refused") {
  mp::run(2, ddp::HostTransport::shm, [](mp::Comm& comm) {
    std::vector<std::vector<float>> memory{{1, 2, 3}, {4, 5}, {6, 7, 8, 9}};
    std::vector<SpanParam> net;
    for (auto& m : memory) net.push_back({m, {}});
    using Shard = ddp::FullyShard<std::vector<SpanParam>, ddp::backend::Host>;
    mp::expect_invalid("parameter 0 is in unit 0 and in unit 1", [&] {
      Shard f(comm, net, {{0, 1}, {0, 2}});
    });
    mp::expect_invalid("parameter 2 is in no unit", [&] { Shard f(comm, net, {{0, 1}}); });
    mp::expect_invalid("lists parameter 3 of a model of 3", [&] {
      Shard f(comm, net, {{0, 1, 2, 3}});
    });
    try {
      Shard f(comm, net,
              comm.rank() == 0 ? std::vector<std::vector<std::size_t>>{{0, 1}, {2}}
                               : std::vector<std::vector<std::size_t>>{{0}, {1, 2}});
      MP_EXPECT(false, "units that differ between ranks were accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
    }
    for (std::size_t i = 0; i < net.size(); ++i) net[i].value = memory[i];
    Shard fsdp(comm, net, {{0, 1}, {2}});
    fsdp.backward(1, [] {});
    mp::expect_invalid("unit 1's backward runs again before step()",
                       [&] { fsdp.backward(1, [] {}); });
    fsdp.step([](auto) {});
    mp::expect_invalid("no forward or backward ran since the last step()",
                       [&] { fsdp.step([](auto) {}); });
    // An update that throws (partly applied, say) is not run again on the same averages.
    fsdp.forward(0, [] {});
    try {
      fsdp.step([](auto) { throw std::runtime_error("the optimizer failed"); });
    } catch (const std::runtime_error&) {
    }
    mp::expect_invalid("no forward or backward ran since the last step()",
                       [&] { fsdp.step([](auto) {}); });
    mp::expect_invalid(
        "unit 0 has no elements (list parameters with elements in it; when a "
        "FullyShard made over this model before",
        [&] {
          Shard again(comm, net, {{0, 1}, {2}});
        });
    net[2].value = memory[2];  // pointed elsewhere while released
    mp::expect_invalid("parameter 2 of unit 1 was given 4 elements while the unit was released",
                       [&] { fsdp.forward(1, [] {}); });
    net[2].value = {};
    mp::expect_invalid("unit 2 of 2", [&] { fsdp.forward(2, [] {}); });
    // A forward that throws leaves its unit released; a backward that throws, the object refused.
    try {
      fsdp.forward(0, [] { throw std::runtime_error("in the forward"); });
    } catch (const std::runtime_error&) {
    }
    MP_EXPECT(net[0].value.empty(), "a failed forward left its unit gathered");
    try {
      fsdp.backward(0, [] { throw std::runtime_error("in the backward"); });
    } catch (const std::runtime_error&) {
    }
    mp::expect_invalid("a backward failed inside its fn", [&] { fsdp.forward(1, [] {}); });
    fsdp.reset(comm);  // the same units again, the shard zeros
    fsdp.forward(1, [&] {
      MP_EXPECT(net[2].value.size() == 4 && net[2].value[3] == 0.0f, "reset kept the shard");
    });
    // Units of one size run in different orders on the ranks: refused at the step, before the
    // update (the shard stays); a step with no forward or backward since construction refused.
    std::vector<std::vector<float>> three{{1, 1}, {2, 2}, {}, {3, 3}};
    std::vector<SpanParam> trio;
    for (auto& m : three) trio.push_back({m, {}});
    Shard ordered(comm, trio, {{0}, {1, 2}, {3}});  // parameter 2: no elements, in a unit
    mp::expect_invalid(
        "no forward or backward ran since the last step() (or since the FullyShard "
        "was made or reset;",
        [&] { ordered.step([](auto) {}); });
    const auto nth = [&](std::size_t k) { return comm.rank() == 0 ? k : 2 - k; };
    for (std::size_t k = 0; k < 3; ++k) ordered.forward(nth(k), [] {});
    for (std::size_t k = 3; k-- > 0;)
      ordered.backward(nth(k), [&] {
        for (float& g : trio[ordered.unit_parameters(nth(k))[0]].grad) g += 1.0f;
      });
    bool updated = false;
    try {
      ordered.step([&](auto) { updated = true; });
      MP_EXPECT(false, "units run in different orders were not noticed");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                    std::string(e.what()).find("different orders this step") != std::string::npos,
                e.what());
    }
    MP_EXPECT(!updated, "the shard was updated from mixed-up averages");
    mp::expect_invalid("a step() that failed counts",  // no retry on those averages
                       [&] { ordered.step([&](auto) { updated = true; }); });
    MP_EXPECT(!updated, "a retried step updated the shard");
    std::vector<float> values;
    ordered.averager().gather_to(0, [&](std::size_t, std::size_t, std::span<const float> v) {
      values.insert(values.end(), v.begin(), v.end());
    });
    if (comm.rank() == 0)
      MP_EXPECT((values == std::vector<float>{1, 1, 2, 2, 3, 3}), "the shard changed");
    // Two parameters of one size swapped between ranks' units: refused, not trained mixed up.
    std::vector<std::vector<float>> same{{1, 2}, {3, 4}};
    std::vector<SpanParam> pair{{same[0], {}}, {same[1], {}}};
    try {
      Shard f(comm, pair,
              comm.rank() == 0 ? std::vector<std::vector<std::size_t>>{{0}, {1}}
                               : std::vector<std::vector<std::size_t>>{{1}, {0}});
      MP_EXPECT(false, "units of swapped parameters were accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                    std::string(e.what()).find("rank 1 lists other units") != std::string::npos,
                e.what());
    }
  });
}

TEST_CASE(
    "FullyShard: units of different sizes run in different orders (the default prefetch): every "
    "rank's error names the units it ran, whichever collective notices first") {
  using Shard = ddp::FullyShard<std::vector<SpanParam>, ddp::backend::Host>;
  for (const mp::Path& path : mp::paths()) {
    CAPTURE(mp::name(path));
    mp::run(2, path, [](mp::Comm& comm) {
      std::vector<std::vector<float>> memory{std::vector<float>(20, 1.0f),
                                             std::vector<float>(60, 2.0f),
                                             std::vector<float>(140, 3.0f)};
      std::vector<SpanParam> net;
      for (auto& m : memory) net.push_back({m, {}});
      Shard fsdp(comm, net, {{0}, {1}, {2}});
      // Step 0 in one order everywhere; in step 1 rank 1 runs its forward backwards (the
      // prefetch follows step 0's order): its first gather, unit 2's, meets rank 0's unit 0.
      for (int step = 0; step < 2; ++step) {
        try {
          for (std::size_t k = 0; k < 3; ++k)
            fsdp.forward(step == 1 && comm.rank() == 1 ? 2 - k : k, [] {});
          for (std::size_t k = 3; k-- > 0;)
            fsdp.backward(k, [&] {
              for (float& g : net[k].grad) g += 1.0f;
            });
          fsdp.step([](auto) {});
          MP_EXPECT(step == 0, "units run in different orders were not noticed");
        } catch (const ddp::Error& e) {
          const std::string m = e.what();
          MP_EXPECT(step == 1 && e.code() == ddp::Errc::mismatch, m);
          MP_EXPECT(m.find("in different orders") != std::string::npos, m);
          // The order this rank ran, whichever way it was noticed (here or at the step's check).
          const std::string mine = comm.rank() == 0 ? "gather 0" : "gather 2";
          MP_EXPECT(m.find("this rank ran " + mine) != std::string::npos ||
                        m.find("rank " + std::to_string(comm.rank()) + " ran " + mine) !=
                            std::string::npos,
                    m);
          return;
        }
      }
    });
  }
}

TEST_CASE(
    "fully sharded: in a ddp::Elastic loop a lost rank's shard comes back from the in-memory "
    "copies, no step lost, bitwise") {
  mp::TempDir dir;
  const std::string want = lost_rank_reference(dir);  // as above
  REQUIRE(!want.empty());
  // The loop in one object: each step saved to the mirror before Elastic commits it; on_reset
  // makes the averager again over the survivors (or resets the FullyShard over the toy model)
  // and loads the restored commit's save. Rank 2 dies at the start of step 8, or inside its
  // backward.
  for (const auto& way : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true},
                          std::pair{true, true}}) {
    const bool inside = way.first, whole_model = way.second;  // (clang 14: no binding captures)
    CAPTURE(inside);
    CAPTURE(whole_model);
    ddp::SpawnOptions so;
    so.stop_on_failure = false;
    so.end_left_out = false;  // fault tests wake the ranks they fence
    try {
      ddp::spawn(
          4,
          [&](ddp::Environment env) {
            using Host = ddp::backend::Host;
            ddp::Options o;
            o.timeout = std::chrono::seconds(20);
            o.segment_bytes = mp::test_segment;
            ddp::Elastic<Host> job(env, o,
                                   {.shrink = {.wait_for_ranks = std::chrono::seconds(10)}});
            ddp::ShardMirror mirror;
            std::optional<ddp::FullyShardedAverager<Host>> fsdp;
            // Or FullyShard over the toy model: made once, reset() after a change.
            auto net = toy_model(env.rank, false);
            const auto units = toy_units();
            std::optional<ddp::FullyShard<std::vector<fully_shard_toy::Param>, Host>> shard;
            Optimizer opt{true};
            std::uint64_t resumed = 0;
            job.on_reset([&](ddp::Communicator<Host>& comm) {
              const bool first = !fsdp.has_value() && !shard.has_value();
              if (whole_model && first) shard.emplace(comm, net, units);
              if (whole_model && !first) shard->reset(comm);
              fsdp.reset();
              if (!whole_model) fsdp.emplace(comm, unit_sizes, first ? init_values : nullptr);
              if (first) return;
              auto& engine = whole_model ? shard->averager() : *fsdp;
              const auto ck = engine.load(mirror, job.steps());
              MP_EXPECT(ck.has_value(), "no save of commit " << job.steps() << " in memory");
              opt.get(*ck, engine.layout().elements());
              resumed = job.steps();
            });
            job.run(12, [&](ddp::Communicator<Host>& comm, std::uint64_t n) {
              const bool victim = env.rank == 2 && n == 8;
              if (victim && !inside) std::_Exit(5);
              const auto die = [&](std::size_t u) {
                if (victim && u == 0) std::_Exit(5);
              };
              if (whole_model)
                toy_step(*shard, net, opt, comm.rank(), static_cast<int>(n), die);
              else
                sharded_step(*fsdp, opt, comm.rank(), static_cast<int>(n), die);
              auto& engine = whole_model ? shard->averager() : *fsdp;
              ddp::Checkpoint state;
              const ddp::ShardLayout layout = engine.layout();
              opt.put(state, &layout);
              engine.save(state, mirror, n + 1);
            });
            MP_EXPECT(resumed == 8 && job.recoveries() == 1,
                      "resumed from commit " << resumed << " after " << job.recoveries()
                                             << " recoveries");
            mp::TempDir::write(dir.file("elastic" + std::to_string(env.rank)),
                               model_bytes(whole_model ? shard->averager() : *fsdp));
          },
          so);
    } catch (const ddp::Error&) {  // rank 2, on purpose
    }
    for (const int r : {0, 1, 3}) {
      CHECK_MESSAGE(mp::TempDir::read(dir.file("elastic" + std::to_string(r))) == want,
                    "survivor " << r << " differs from the reference");
      std::remove(dir.file("elastic" + std::to_string(r)).c_str());
    }
  }
}

}  // namespace fully_sharded_tests
