// TorchFullyShard across real processes: a libtorch module whose units live sharded trains
// bitwise as GradientAverager over the whole module does (an elementwise optimizer on both),
// torch's optimizers on the shard keep 1/P of their state, and what a user gets wrong is refused.
#include <ddp/adapters/torch.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "multiprocess.hpp"

// Named, so that the executable can be built as one unity translation unit.
namespace torch_fully_sharded_tests {
namespace {

using mp::Comm;
using Fsdp = ddp::TorchFullyShard<ddp::backend::Host>;

/// Three layers and a parameter of the root's own (the fourth unit), used between the first two.
struct DeepImpl : torch::nn::Module {
  DeepImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 16))),
        fc3(register_module("fc3", torch::nn::Linear(16, 4))),
        scale(register_parameter("scale", torch::rand({16}) + 0.5)) {}
  /// The whole module (GradientAverager's reference).
  torch::Tensor forward(const torch::Tensor& x, bool skip = false) {
    const auto h = torch::relu(fc1(x)) * scale;
    return fc3(torch::tanh(skip ? h : fc2(h)));
  }
  /// The same, a unit at a time.
  template <class F>
  torch::Tensor forward(F& f, const torch::Tensor& x, bool skip = false) {
    auto h = f.forward(0, [&] { return fc1(x); });
    h = f.forward(3, [&] { return torch::relu(h) * scale; });
    if (!skip) h = f.forward(1, [&] { return fc2(h); });
    return f.forward(2, [&] { return fc3(torch::tanh(h)); });
  }
  std::vector<std::shared_ptr<torch::nn::Module>> units() {
    return {fc1.ptr(), fc2.ptr(), fc3.ptr(), shared_from_this()};
  }
  torch::nn::Linear fc1, fc2, fc3;
  torch::Tensor scale;
};
TORCH_MODULE(Deep);

/// Rank r's batch k: inputs and targets, different on every rank.
std::pair<torch::Tensor, torch::Tensor> data(int r, int k) {
  torch::manual_seed(static_cast<std::uint64_t>(500 + 31 * r + k));
  return {torch::randn({5, 8}), torch::randn({5, 4})};
}

/// SGD with momentum 0.9 (lr 0.05) or Adam (lr 0.01), elementwise over (values, gradients) pairs
/// in order, with state per element of them end to end: the same arithmetic on a whole model and
/// on a shard.
struct Elementwise {
  bool adam = false;
  std::vector<float> m{}, v{};
  int t = 0;
  void step(const std::vector<std::pair<float*, const float*>>& x,
            const std::vector<std::size_t>& n) {
    std::size_t total = 0;
    for (const std::size_t k : n) total += k;
    m.resize(total, 0.0f);
    v.resize(total, 0.0f);
    ++t;
    const auto c1 = static_cast<float>(1.0 - std::pow(0.9, t));
    const auto c2 = static_cast<float>(1.0 - std::pow(0.999, t));
    std::size_t j = 0;
    for (std::size_t s = 0; s < x.size(); ++s) {
      for (std::size_t k = 0; k < n[s]; ++k, ++j) {
        const float g = x[s].second[k];
        if (adam) {
          m[j] = 0.9f * m[j] + 0.1f * g;
          v[j] = 0.999f * v[j] + 0.001f * g * g;
          x[s].first[k] -= 0.01f * (m[j] / c1) / (std::sqrt(v[j] / c2) + 1e-8f);
        } else {
          m[j] = 0.9f * m[j] + g;
          x[s].first[k] -= 0.05f * m[j];
        }
      }
    }
  }
};

/// The module's parameters (unit order: fc1, fc2, fc3, scale) as one float tensor.
torch::Tensor flat(Deep& net) {
  std::vector<torch::Tensor> parts;
  for (auto* m : {&*net->fc1, &*net->fc2, &*net->fc3})
    for (const auto& p : m->parameters()) parts.push_back(p.detach().flatten());
  parts.push_back(net->scale.detach().flatten());
  return torch::cat(parts);
}

/// `steps` steps of GradientAverager over the whole module; its parameters after them.
/// With `skip`, every third step from the second leaves fc2 out (a unit unused in a step).
torch::Tensor whole(Comm& comm, bool adam, int steps, bool skip = false) {
  torch::manual_seed(static_cast<std::uint64_t>(comm.rank()));  // rank 0's are copied
  Deep net;
  ddp::GradientAverager avg(comm, *net);
  Elementwise opt{adam};
  for (int k = 0; k < steps; ++k) {
    const auto [x, y] = data(comm.rank(), k);
    for (auto& p : net->parameters()) p.mutable_grad().zero_();
    torch::mse_loss(net->forward(x, skip && k % 3 == 1), y).backward();
    avg.synchronize();
    std::vector<std::pair<float*, const float*>> xs;
    std::vector<std::size_t> n;
    for (auto& p : net->parameters()) {
      xs.emplace_back(p.data_ptr<float>(), p.grad().data_ptr<float>());
      n.push_back(static_cast<std::size_t>(p.numel()));
    }
    opt.step(xs, n);
  }
  return flat(net);
}

/// The whole model at rank 0, a tensor per parameter (none elsewhere).
template <class F>
std::vector<torch::Tensor> gathered(F& f) {
  std::vector<torch::Tensor> parts;
  f.averager().gather_to(0, [&](std::size_t, std::size_t, std::span<const float> v) {
    parts.push_back(
        torch::from_blob(const_cast<float*>(v.data()), {static_cast<std::int64_t>(v.size())})
            .clone());
  });
  return parts;
}

/// The elementwise optimizer on a fully sharded module's shard (its averaged gradients).
template <class F>
void shard_step(F& f, Elementwise& opt) {
  std::vector<std::pair<float*, const float*>> xs;
  std::vector<std::size_t> n;
  for (const auto& s : f.averager().shard()) {
    xs.emplace_back(s.value.data, s.grad.data);
    n.push_back(s.value.size);
  }
  opt.step(xs, n);
}

/// The same run fully sharded; the whole model gathered to rank 0 after it (empty elsewhere).
torch::Tensor sharded(Comm& comm, bool adam, int steps, ddp::TorchFullyShardOptions o,
                      bool skip = false) {
  torch::manual_seed(static_cast<std::uint64_t>(comm.rank()));
  Deep net;
  Fsdp f(comm, net->units(), o);
  for (const auto& p : net->parameters())
    MP_EXPECT(p.numel() == 0, "a released unit's parameter has " << p.numel() << " elements");
  Elementwise opt{adam};
  for (int k = 0; k < steps; ++k) {
    const auto [x, y] = data(comm.rank(), k);
    torch::mse_loss(net->forward(f, x, skip && k % 3 == 1), y).backward();
    f.synchronize();
    if (k % 2 == 0) f.synchronize();  // again: nothing more (the averages stay)
    shard_step(f, opt);
    for (const auto& p : net->parameters())
      MP_EXPECT(p.numel() == 0 && !p.grad().defined(), "unit not released after step " << k);
  }
  const auto parts = gathered(f);
  return parts.empty() ? torch::Tensor() : torch::cat(parts);
}

bool bitwise(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), static_cast<std::size_t>(a.nbytes())) == 0;
}

/// Mixed precision by hand, the reference: float masters, a bfloat16 copy of the module computing
/// (its inputs cast), its bfloat16 gradients averaged by GradientAverager, the optimizer on the
/// masters. The masters after `steps` steps.
torch::Tensor whole_bf16(Comm& comm, int steps) {
  torch::manual_seed(static_cast<std::uint64_t>(comm.rank()));
  Deep net;
  std::vector<torch::Tensor> masters;
  for (auto& p : net->parameters()) masters.push_back(p.detach().clone());
  net->to(torch::kBFloat16);
  ddp::GradientAverager avg(comm, *net);  // copies rank 0's parameters
  for (std::size_t i = 0; i < masters.size(); ++i) {
    torch::NoGradGuard no_grad;
    comm.broadcast(masters[i], 0);
  }
  Elementwise opt{true};
  for (int k = 0; k < steps; ++k) {
    {
      torch::NoGradGuard no_grad;
      std::size_t i = 0;
      for (auto& p : net->parameters()) p.copy_(masters[i++]);  // rounded to bfloat16
    }
    const auto [x, y] = data(comm.rank(), k);
    for (auto& p : net->parameters()) p.mutable_grad() = torch::zeros_like(p);
    torch::mse_loss(net->forward(x.to(torch::kBFloat16)).to(torch::kFloat), y).backward();
    avg.synchronize();
    std::vector<torch::Tensor> grads;
    std::vector<std::pair<float*, const float*>> xs;
    std::vector<std::size_t> n;
    std::size_t i = 0;
    for (auto& p : net->parameters()) {
      grads.push_back(p.grad().to(torch::kFloat));
      xs.emplace_back(masters[i++].data_ptr<float>(), grads.back().data_ptr<float>());
      n.push_back(static_cast<std::size_t>(p.numel()));
    }
    opt.step(xs, n);
  }
  net->to(torch::kFloat);
  torch::NoGradGuard no_grad;
  std::size_t i = 0;
  for (auto& p : net->parameters()) p.copy_(masters[i++]);
  return flat(net);  // in the units' order
}

}  // namespace

TEST_CASE(
    "TorchFullyShard: a libtorch module's units sharded train bitwise as GradientAverager, "
    "SGD-momentum and Adam, worlds 1-4, shm and tcp") {
  for (const ddp::HostTransport t : {ddp::HostTransport::shm, ddp::HostTransport::tcp}) {
    for (int world = 1; world <= 4; ++world) {
      if (t == ddp::HostTransport::tcp && world != 3) continue;
      mp::run(world, t, [](Comm& comm) {
        torch::set_num_threads(1);
        for (const bool adam : {false, true}) {
          const auto ref = whole(comm, adam, 20);
          const auto got = sharded(comm, adam, 20, {});
          if (comm.rank() == 0)
            MP_EXPECT(bitwise(ref, got), (adam ? "Adam" : "SGD")
                                             << ": differs by " << (ref - got).abs().max());
        }
      });
    }
  }
}

TEST_CASE(
    "TorchFullyShard: units kept from the forward for the backward, without prefetch, and a unit "
    "unused in some steps: bitwise the same run, and torch's Adam on the shard keeps 1/P of the "
    "moments") {
  mp::run(3, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    const auto ref = whole(comm, true, 6);
    for (const auto o : {ddp::TorchFullyShardOptions{.reshard_after_forward = false},
                         ddp::TorchFullyShardOptions{.prefetch = false}}) {
      const auto got = sharded(comm, true, 6, o);
      if (comm.rank() == 0) MP_EXPECT(bitwise(ref, got), "differs by " << (ref - got).abs().max());
    }
    // A unit left out of a step (prefetched there, from the step before's order, and unused):
    // reduced with zero gradients, and gathered afresh when it is used again.
    const auto ref_skip = whole(comm, false, 6, true), got_skip = sharded(comm, false, 6, {}, true);
    if (comm.rank() == 0)
      MP_EXPECT(bitwise(ref_skip, got_skip),
                "skipping fc2: differs by " << (ref_skip - got_skip).abs().max());
    // torch::optim::Adam over the shard's tensors, against Adam over the whole module.
    torch::manual_seed(static_cast<std::uint64_t>(comm.rank()));
    Deep full;
    ddp::GradientAverager avg(comm, *full);
    torch::optim::Adam full_opt(full->parameters(), torch::optim::AdamOptions(0.01));
    torch::manual_seed(static_cast<std::uint64_t>(comm.rank()));
    Deep net;
    Fsdp f(comm, net->units());
    torch::optim::Adam opt(f.parameters(), torch::optim::AdamOptions(0.01));
    for (int k = 0; k < 6; ++k) {
      const auto [x, y] = data(comm.rank(), k);
      full_opt.zero_grad();
      torch::mse_loss(full->forward(x), y).backward();
      avg.synchronize();
      full_opt.step();
      opt.zero_grad();
      torch::mse_loss(net->forward(f, x), y).backward();
      f.step(opt);
    }
    std::int64_t moments = 0;
    for (auto& [key, state] : opt.state())
      moments += static_cast<torch::optim::AdamParamState&>(*state).exp_avg().numel();
    std::int64_t mine = 0;
    for (const auto& s : f.averager().shard()) mine += static_cast<std::int64_t>(s.value.size);
    MP_EXPECT(moments == mine && mine * comm.size() < flat(full).numel() + 4 * comm.size(),
              "Adam keeps " << moments << " moments, the shard " << mine);
    const auto parts = gathered(f);
    if (comm.rank() == 0) {
      const auto a = torch::cat(parts), b = flat(full);
      const double diff = ((a - b).abs() / b.abs().clamp_min(1e-3)).max().item<double>();
      MP_EXPECT(diff <= 1e-6, "sharded torch Adam differs from Adam by " << diff);
    }
  });
}

TEST_CASE(
    "TorchFullyShard: torch's Adam state and the shard saved by 3 ranks, loaded and saved again "
    "by 2, loaded by 3: the run goes on bitwise as the one that never stopped") {
  mp::TempDir dir;
  const std::string path = dir.file("fsdp"), straight = dir.file("straight");
  const auto run_steps = [](Comm& comm, Deep& net, Fsdp& f, torch::optim::Adam& opt, int from,
                            int to) {
    for (int k = from; k < to; ++k) {
      const auto [x, y] = data(comm.rank(), k);
      opt.zero_grad();
      torch::mse_loss(net->forward(f, x), y).backward();
      f.step(opt);
    }
  };
  const auto whole_model = [](Fsdp& f) {
    std::string out;
    f.averager().gather_to(0, [&](std::size_t, std::size_t, std::span<const float> v) {
      out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    });
    return out;
  };
  mp::run(3, ddp::HostTransport::shm, [&](Comm& comm) {
    torch::set_num_threads(1);
    torch::manual_seed(5);
    Deep net;
    Fsdp f(comm, net->units());
    torch::optim::Adam opt(f.parameters(), torch::optim::AdamOptions(0.01));
    run_steps(comm, net, f, opt, 0, 3);
    ddp::Checkpoint state;
    ddp::put_optimizer(state, "adam", opt, f);
    f.averager().save(state, path);
    run_steps(comm, net, f, opt, 3, 6);
    const std::string model = whole_model(f);
    if (comm.rank() == 0) mp::TempDir::write(straight, model);
  });
  const auto resume = [&](Comm& comm, const std::string& from, const std::string& to) {
    torch::set_num_threads(1);
    torch::manual_seed(static_cast<std::uint64_t>(9 + comm.size()));  // replaced by the load
    Deep net;
    Fsdp f(comm, net->units());
    torch::optim::Adam opt(f.parameters(), torch::optim::AdamOptions(0.01));
    const auto st = f.averager().load(from);
    MP_EXPECT(st.has_value(), "no checkpoint at " << from);
    ddp::get_optimizer(*st, "adam", opt, f);
    std::int64_t held = 0;
    for (const auto& [key, s] : opt.state())
      held += static_cast<torch::optim::AdamParamState&>(*s).exp_avg().numel();
    std::int64_t mine = 0;
    for (const auto& s : f.averager().shard()) mine += static_cast<std::int64_t>(s.value.size);
    MP_EXPECT(held == mine, "Adam's state for " << held << " elements, the shard " << mine);
    if (!to.empty()) {  // cut for this world, saved again
      ddp::Checkpoint again;
      ddp::put_optimizer(again, "adam", opt, f);
      f.averager().save(again, to);
      return;
    }
    run_steps(comm, net, f, opt, 3, 6);
    const std::string model = whole_model(f);
    if (comm.rank() == 0)
      MP_EXPECT(model == mp::TempDir::read(straight),
                "resumed through 2 ranks, the run differs from the one that went on");
  };
  const std::string again = dir.file("again");
  mp::run(2, ddp::HostTransport::shm, [&](Comm& comm) { resume(comm, path, again); });
  mp::run(3, ddp::HostTransport::shm, [&](Comm& comm) { resume(comm, again, ""); });
}

TEST_CASE(
    "TorchFullyShard: a unit with a frozen layer before a trainable one trains, and the frozen "
    "parameters stay as they were, with weight decay") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    torch::manual_seed(3);
    torch::nn::Linear first(8, 16), q(16, 16), last(16, 4);
    torch::nn::Sequential block(q, last);
    for (auto& p : q->parameters()) p.set_requires_grad(false);
    const auto frozen = q->weight.detach().clone(), trained = last->weight.detach().clone();
    Fsdp f(comm, {first.ptr(), block.ptr()});
    torch::optim::SGD opt(f.parameters(), torch::optim::SGDOptions(0.1).weight_decay(0.5));
    for (int k = 0; k < 4; ++k) {
      const auto [x, y] = data(comm.rank(), k);
      opt.zero_grad();
      auto h = f.forward(0, [&] { return first(x); });
      const auto loss = torch::mse_loss(f.forward(1, [&] { return block->forward(h); }), y);
      loss.backward();  // Q's backward needs its weight after P's gradients are reduced
      f.step(opt);
    }
    const auto params = gathered(f);
    if (comm.rank() == 0) {  // unit 1: Q's weight, Q's bias, P's weight, P's bias
      MP_EXPECT(params.size() == 6, params.size());
      MP_EXPECT(bitwise(params[2], frozen.flatten()), "the frozen weight moved");
      MP_EXPECT(!bitwise(params[4], trained.flatten()), "the trainable weight did not move");
    }
    // Freezing after construction is refused at the next backward.
    for (auto& p : last->parameters()) p.set_requires_grad(false);
    const auto [x, y] = data(comm.rank(), 9);
    auto h = f.forward(0, [&] { return first(x); });
    const auto out = f.forward(1, [&] { return block->forward(h); });
    mp::expect_refused(comm, "a parameter frozen after construction", "was frozen after",
                       [&] { torch::mse_loss(out, y).backward(); });
  });
}

TEST_CASE(
    "TorchFullyShard<Backend, bfloat16>: parameters gathered and computed in bfloat16, float "
    "masters, bitwise mixed precision by hand over GradientAverager") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    const torch::Tensor want = whole_bf16(comm, 6);
    torch::manual_seed(static_cast<std::uint64_t>(comm.rank()));
    Deep net;
    ddp::TorchFullyShard<ddp::backend::Host, ddp::bfloat16> f(comm, net->units());
    MP_EXPECT(f.parameters()[0].scalar_type() == torch::kFloat, "the masters are not float");
    Elementwise opt{true};
    for (int k = 0; k < 6; ++k) {
      const auto [x, y] = data(comm.rank(), k);
      (void)f.forward(0, [&] {
        MP_EXPECT(net->fc1->weight.scalar_type() == torch::kBFloat16,
                  "gathered as " << net->fc1->weight.scalar_type());
        return x;
      });
      torch::mse_loss(net->forward(f, x.to(torch::kBFloat16)).to(torch::kFloat), y).backward();
      f.synchronize();
      shard_step(f, opt);
    }
    const auto parts = gathered(f);
    if (comm.rank() == 0)
      MP_EXPECT(bitwise(torch::cat(parts), want), "the masters differ from the reference");
  });
}

TEST_CASE("TorchFullyShard: what a user gets wrong is refused, naming the unit") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    torch::manual_seed(1);
    const auto [x, y] = data(comm.rank(), 0);
    {
      Deep net;
      mp::expect_refused(comm, "a module listed twice", "is the module of unit 0 again", [&] {
        Fsdp(comm, {net->fc1.ptr(), net->fc1.ptr()});
      });
    }
    {
      Deep net;
      net->fc2->to(torch::kDouble);
      mp::expect_refused(comm, "a double parameter", "is not a float tensor",
                         [&] { Fsdp(comm, net->units()); });
    }
    {
      Deep net;
      Fsdp f(comm, net->units());
      // A unit's module run inside another unit's forward: its parameters have no elements.
      mp::expect_refused(comm, "a unit used before it was gathered", "units 0, 2, 3 are released",
                         [&] { (void)f.forward(1, [&] { return net->fc2(net->fc1(x)); }); });
      // A parameter changed in size while its unit is released.
      {
        torch::NoGradGuard no_grad;
        net->fc3->weight.set_data(torch::zeros({5, 16}));
      }
      mp::expect_refused(comm, "a parameter changed in size", "was given 80 elements", [&] {
        (void)f.forward(2, [&] { return net->fc3(torch::randn({5, 16})); });
      });
    }
    {
      Deep net;
      Fsdp f(comm, net->units());
      // The unit's output kept aside: nothing gathers it for the backward.
      torch::Tensor h;
      (void)f.forward(0, [&] {
        h = net->fc1(x);
        return x;
      });
      mp::expect_refused(comm, "gradients that no output of forward led to",
                         "no output of forward(0, fn) led there", [&] { h.sum().backward(); });
    }
    {
      Deep net;
      Fsdp f(comm, net->units());
      torch::mse_loss(net->forward(f, x), y).backward();
      mp::expect_refused(comm, "a second forward and backward before step()",
                         "'s forward runs again after its backward, before step()",
                         [&] { torch::mse_loss(net->forward(f, x), y).backward(); });
      {  // evaluating between the backward and the step is fine
        torch::NoGradGuard no_grad;
        MP_EXPECT(net->forward(f, x).sizes() == y.sizes(), "the evaluation's output");
      }
      torch::optim::SGD opt(f.parameters(), torch::optim::SGDOptions(0.1));
      f.step(opt);
      mp::expect_refused(comm, "a second step() on the same averages",
                         "no forward ran (with grad mode on) since the last step()",
                         [&] { f.step(opt); });
      {  // evaluating does not start a step either
        torch::NoGradGuard no_grad;
        (void)net->forward(f, x);
      }
      mp::expect_refused(comm, "a step() after an evaluation only", "since the last step()",
                         [&] { f.step(opt); });
      torch::mse_loss(net->forward(f, x), y).backward();  // the next step: accepted
      f.step(opt);
    }
    {
      Deep net;
      Fsdp f(comm, net->units());
      torch::optim::SGD opt(f.parameters(), torch::optim::SGDOptions(0.1));
      mp::expect_refused(comm, "a step() before any forward", "since the TorchFullyShard was made",
                         [&] { f.step(opt); });
    }
    {
      Deep net;
      Fsdp f(comm, net->units());
      mp::expect_refused(comm, "a view of the unit's parameters returned",
                         "returned a view of its own parameters",
                         [&] { (void)f.forward(0, [&] { return net->fc1->weight.t(); }); });
      torch::optim::SGD whole_opt(net->parameters(), torch::optim::SGDOptions(0.1));
      mp::expect_refused(comm, "an optimizer over the module's parameters",
                         "make it over fsdp.parameters()", [&] { f.step(whole_opt); });
    }
    {
      Deep net;
      Fsdp f(comm, net->units());
      const auto loss = torch::mse_loss(net->forward(f, x), y);
      mp::expect_refused(comm, "a backward with create_graph", "create_graph",
                         [&] { loss.backward({}, true, true); });
    }
    {
      Deep net;
      mp::expect_refused(comm, "a unit out of range", "unit 4 of 4", [&] {
        Fsdp f(comm, net->units());
        (void)f.forward(4, [&] { return x; });
      });
    }
    {
      // Units of one size run in different orders on the ranks: Errc::mismatch at step(), before
      // the update.
      torch::nn::Linear a(16, 16), b(16, 16);
      Fsdp f(comm, {a.ptr(), b.ptr()});
      torch::Tensor h = torch::randn({5, 16});
      for (const std::size_t u : {std::size_t{0}, std::size_t{1}}) {
        const std::size_t unit = comm.rank() == 0 ? u : 1 - u;
        h = f.forward(unit, [&] { return (unit == 0 ? a : b)(h); });
      }
      h.sum().backward();
      torch::optim::SGD opt(f.parameters(), torch::optim::SGDOptions(0.1));
      const at::Tensor before = f.parameters()[0].clone();
      try {
        f.step(opt);
        MP_EXPECT(false, "units run in different orders were not noticed");
      } catch (const ddp::Error& e) {
        MP_EXPECT(e.code() == ddp::Errc::mismatch &&
                      std::string(e.what()).find("different orders this step") != std::string::npos,
                  e.what());
      }
      MP_EXPECT(f.parameters()[0].equal(before), "the shard was updated");
      mp::expect_refused(comm, "a step() retried after the check failed",
                         "a step() that failed counts", [&] { f.step(opt); });
      MP_EXPECT(f.parameters()[0].equal(before), "a retried step updated the shard");
    }
    // Ranks whose units differ: Errc::mismatch on every rank.
    Deep net;
    auto units = net->units();
    if (comm.rank() == 1) units.erase(units.begin() + 1);
    try {
      Fsdp f(comm, units);
      MP_EXPECT(false, "units that differ between ranks were accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
    }
  });
}

}  // namespace torch_fully_sharded_tests
