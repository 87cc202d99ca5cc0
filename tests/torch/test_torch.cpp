// libtorch's torch::Tensor through ddp (include/ddp/adapters/torch.hpp), in real forked
// processes: every dtype through every collective against the references of the unit tests,
// tensors torch owns, and every refusal.
#include <ddp/adapters/torch.hpp>

#include <torch/torch.h>

#include "collective_cases.hpp"

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace {

using ddp::ReduceOp;
using mp::Comm;

/// Whether this libtorch has the unsigned types of 16 to 64 bits (2.3 and later).
template <class S = c10::ScalarType>
constexpr bool torch_has_unsigned = requires {
  S::UInt16;
};

/// Passes a case's buffer as a torch::Tensor over the same memory (torch::from_blob); the
/// dtypes torch 1.13 lacks (uint16, uint32, uint64) pass as they are there.
struct AsTorch {
  template <class B>
  decltype(auto) operator()(B&& b) const {
    using E = std::remove_cvref_t<decltype(*std::ranges::data(b))>;
    const auto type = ddp::torch_detail::scalar_type_of(ddp::dtype_of<E>);
    if constexpr (!torch_has_unsigned<> &&
                  (std::is_same_v<E, std::uint16_t> || std::is_same_v<E, std::uint32_t> ||
                   std::is_same_v<E, std::uint64_t>)) {
      return std::forward<B>(b);
    } else {
      return torch::from_blob(const_cast<E*>(std::ranges::data(b)),
                              {static_cast<std::int64_t>(std::ranges::size(b))},
                              torch::TensorOptions().dtype(*type));
    }
  }
};

/// Runs `call` and expects Errc::invalid_argument naming the rank and `needle`.
template <class F>
void refused(const Comm& comm, const char* what, const std::string& needle, F&& call) {
  mp::expect_refused(comm, what, needle, call);
}

}  // namespace

TEST_CASE("torch::Tensor: every dtype through every collective, sync and async") {
  mp::each_world([](Comm& comm) {
    torch::set_num_threads(1);
    const AsTorch wrap;
    cases::all_reduce_every_dtype(comm, wrap);
    cases::reduce_to_root(comm, wrap);
    cases::broadcast_every_root(comm, wrap);
    cases::all_gather_and_gather(comm, wrap);
    cases::scatter_reduce_scatter_all_to_all(comm, wrap);
    cases::all_reduce_coalesced(comm, wrap);
    cases::premul_sum_every_form(comm, wrap);
    cases::named_roles(comm, wrap);
    if (comm.size() > 1) cases::send_recv_ring(comm, wrap);
    cases::async_in_issue_order(comm, wrap);
  });
}

TEST_CASE("torch::Tensor: tensors torch owns, every op, and the result seen by torch") {
  mp::run(3, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    const int p = comm.size(), r = comm.rank();
    // A 2-D float tensor: all_reduce sums in place; torch sees the result.
    auto x = torch::full({4, 5}, static_cast<double>(r + 1), torch::kFloat);
    comm.all_reduce(x);
    MP_EXPECT(torch::equal(x, torch::full({4, 5}, p * (p + 1) / 2.0, torch::kFloat)), x);
    // avg on float64, max on int64, async.
    auto d = torch::arange(10, torch::kDouble) * (r + 1);
    comm.all_reduce_async(d, ReduceOp::avg).wait();
    MP_EXPECT(torch::allclose(d, torch::arange(10, torch::kDouble) * ((p + 1) / 2.0)), d);
    auto l = torch::tensor({static_cast<std::int64_t>(r), std::int64_t{-r}}, torch::kLong);
    comm.all_reduce(l, ReduceOp::max);
    MP_EXPECT(l[0].item<std::int64_t>() == p - 1 && l[1].item<std::int64_t>() == 0, l);
    // bfloat16 and half broadcast from the last rank.
    for (auto type : {torch::kBFloat16, torch::kHalf}) {
      auto h = torch::full({7}, static_cast<double>(r), type);
      comm.broadcast(h, p - 1);
      MP_EXPECT(torch::equal(h, torch::full({7}, static_cast<double>(p - 1), type)), h);
    }
    // all_gather into a [p, 3] tensor; a row of it is contiguous, so it is a valid input.
    auto rows = torch::empty({p, 3}, torch::kInt);
    rows[r].fill_(r * 10);
    comm.all_gather(rows[r], rows);
    for (int k = 0; k < p; ++k)
      MP_EXPECT(torch::equal(rows[k], torch::full({3}, k * 10, torch::kInt)), rows);
    // all_reduce_coalesced over a std::vector<torch::Tensor> of several dtypes.
    std::vector<torch::Tensor> many{torch::ones({3}, torch::kFloat), torch::ones({2}, torch::kByte),
                                    torch::ones({5}, torch::kChar)};
    comm.all_reduce_coalesced(many);
    for (const auto& t : many) MP_EXPECT(torch::all(t == p).item<bool>(), t);
    // torch.bool: a flag any rank raised (bor), one every rank raised (band).
    auto any = torch::tensor({r == p - 1, false}, torch::kBool);
    auto all = torch::tensor({true, r == 0}, torch::kBool);
    comm.all_reduce(any, ReduceOp::bor);
    comm.all_reduce(all, ReduceOp::band);
    MP_EXPECT(any[0].item<bool>() && !any[1].item<bool>(), any);
    MP_EXPECT(all[0].item<bool>() && !all[1].item<bool>(), all);
    // bxor on int32; premul_sum on float32 (each rank's values times its factor, then summed).
    auto bits = torch::tensor({1 << r, 3}, torch::kInt);
    comm.all_reduce(bits, ReduceOp::bxor);
    MP_EXPECT(bits[0].item<int>() == (1 << p) - 1 && bits[1].item<int>() == (p % 2 == 1 ? 3 : 0),
              bits);
    auto scaled = torch::full({3}, 2.0f);
    comm.all_reduce(scaled, ddp::premul_sum(0.5 * (r + 1)));
    MP_EXPECT(torch::equal(scaled, torch::full({3}, p * (p + 1) / 2.0, torch::kFloat)), scaled);
  });
}

TEST_CASE("torch::Tensor: an async collective keeps a tensor alive that its caller dropped") {
  for (const mp::Path& t : {mp::Path(ddp::HostTransport::shm), mp::Path(ddp::HostTransport::tcp)}) {
    CAPTURE(mp::name(t));
    mp::run(2, t, [](Comm& comm) {
      torch::set_num_threads(1);
      // 1 KiB (reused by the allocator at once) and 4 MiB (returned to the kernel): the caller
      // drops its tensors while the operations wait for rank 1, then makes new ones of the same
      // sizes that must not be touched.
      for (const std::int64_t n : {std::int64_t{256}, std::int64_t{1} << 20}) {
        if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
        std::vector<ddp::Work> works;
        {
          auto a = torch::full({n}, static_cast<float>(comm.rank() + 1));
          auto b = torch::full({n}, 5.0f);
          auto gathered = torch::zeros({2 * n});
          works.push_back(comm.all_reduce_async(a));
          works.push_back(comm.broadcast_async(b, 1));
          works.push_back(comm.all_gather_async(a, gathered));
          std::vector<torch::Tensor> many{torch::ones({n}), torch::ones({n})};
          works.push_back(comm.all_reduce_coalesced_async(many));
        }  // every tensor given to the operations is dropped here
        std::vector<torch::Tensor> fresh;
        for (int i = 0; i < 6; ++i) fresh.push_back(torch::full({n}, 7.0f));
        for (auto& w : works) w.wait();
        for (const auto& f : fresh) {
          MP_EXPECT(f.eq(7.0f).all().item<bool>(),
                    "a live tensor was overwritten (n = " << n << ")");
        }
      }
      // The result reaches whoever still holds the tensor.
      auto kept = torch::full({1000}, static_cast<float>(comm.rank() + 1));
      auto w = comm.all_reduce_async(torch::Tensor(kept));  // the argument is a temporary
      w.wait();
      MP_EXPECT(kept.eq(3.0f).all().item<bool>(), "the result did not reach the tensor");
    });
  }
}

TEST_CASE("torch::Tensor: what a collective refuses, before anything is sent") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    auto m = torch::ones({4, 6});
    refused(comm, "a transpose", "all_reduce: `buf` is not contiguous", [&] {
      auto t = m.t();
      comm.all_reduce(t);
    });
    refused(comm, "a strided slice", "broadcast: `buf` is not contiguous", [&] {
      auto s = m.slice(1, 0, 6, 2);
      comm.broadcast(s, 0);
    });
    refused(comm, "an expanded tensor", "all_gather: `in` is not contiguous", [&] {
      auto e = torch::ones({1}).expand({4});
      auto out = torch::empty({8});
      comm.all_gather(e, out);
    });
    refused(comm, "an undefined tensor", "an undefined torch::Tensor", [&] {
      torch::Tensor undefined;
      comm.all_reduce(undefined);
    });
    refused(comm, "a gradient before the first backward", "`buf` cannot be used", [&] {
      auto w = torch::ones({3}, torch::requires_grad());
      auto g = w.grad();
      comm.all_reduce(g);
    });
    refused(comm, "avg on a bool tensor", "op avg is not defined on bool", [&] {
      auto b = torch::ones({3}, torch::kBool);
      comm.all_reduce(b, ReduceOp::avg);
    });
    refused(comm, "a complex tensor", "a dtype ddp does not carry", [&] {
      auto c = torch::ones({3}, torch::kComplexFloat);
      comm.all_reduce(c);
    });
    refused(comm, "a sparse tensor", "not strided", [&] {
      auto s = torch::eye(3).to_sparse();
      comm.all_reduce(s);
    });
    refused(comm, "a tensor on the meta device", "a device other than CPU and CUDA", [&] {
      auto t = torch::empty({3}, torch::TensorOptions().device(torch::kMeta));
      comm.all_reduce(t);
    });
    // A tensor that says it is on CUDA, made over host memory without touching a GPU (neither
    // libtorch makes a real one here: Debian's has no CUDA, pip's finds no GPU). It is refused:
    // by this libtorch (it cannot give the tensor's stream), or by ddp built without CUDA.
    float host[3] = {1, 2, 3};
    auto impl = c10::make_intrusive<c10::TensorImpl>(
        c10::Storage(c10::Storage::use_byte_size_t(), sizeof host,
                     c10::DataPtr(host, c10::Device(c10::DeviceType::CUDA, 0)), nullptr, false),
        c10::DispatchKeySet(c10::DispatchKey::CUDA), caffe2::TypeMeta::Make<float>());
    impl->set_sizes_contiguous({3});
    const torch::Tensor cuda_tensor(std::move(impl));
    MP_EXPECT(cuda_tensor.is_cuda(), cuda_tensor.device());
    refused(comm, "a CUDA tensor, without CUDA", "CUDA", [&] {
      auto t = cuda_tensor;
      comm.all_reduce(t);
    });
    refused(comm, "avg on an integer tensor", "avg needs a floating-point type", [&] {
      auto i = torch::ones({3}, torch::kInt);
      comm.all_reduce(i, ReduceOp::avg);
    });
    refused(comm, "mixed dtypes in all_gather", "they must have the same element type", [&] {
      auto in = torch::ones({2}, torch::kFloat);
      auto out = torch::empty({4}, torch::kDouble);
      comm.all_gather(in, out);
    });
    refused(comm, "a wrong output size", "all_gather: `out` has 5 elements", [&] {
      auto in = torch::ones({2});
      auto out = torch::empty({5});
      comm.all_gather(in, out);
    });
    // Still usable: a contiguous copy of the transpose works.
    auto t = m.t().contiguous();
    comm.all_reduce(t);
    MP_EXPECT(torch::all(t == 2).item<bool>(), t);
  });
}

namespace {

/// A small model with every kind of state: linear layers, BatchNorm (running statistics and a
/// count as buffers: float32 and int64).
struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        bn(register_module("bn", torch::nn::BatchNorm1d(16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1;
  torch::nn::BatchNorm1d bn;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

/// Rank r's batch k: the same on every run, different on every rank.
std::pair<torch::Tensor, torch::Tensor> batch(int r, int k, int n = 6) {
  torch::manual_seed(static_cast<std::uint64_t>(1000 + 17 * r + k));
  return {torch::randn({n, 8}), torch::randint(0, 4, {n}, torch::kLong)};
}

/// Every parameter and buffer of the model, flattened into one float64 tensor.
torch::Tensor state_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (const auto& p : m.parameters()) parts.push_back(p.detach().to(torch::kDouble).flatten());
  for (const auto& b : m.buffers()) parts.push_back(b.detach().to(torch::kDouble).flatten());
  return torch::cat(parts);
}

/// Whether `t` is bitwise the same on every rank.
bool same_everywhere(Comm& comm, const torch::Tensor& t) {
  auto all = torch::empty({comm.size(), t.numel()}, t.options());
  comm.all_gather(t.contiguous(), all);
  for (int k = 1; k < comm.size(); ++k)
    if (!torch::equal(all[k], all[0])) return false;
  return true;
}

/// Trains `steps` SGD steps on rank-specific data; returns the final state.
torch::Tensor train(Comm& comm, bool hooks, int steps) {
  torch::manual_seed(
      static_cast<std::uint64_t>(comm.rank()));  // a different initialization on every rank
  Net net;
  ddp::GradientAverager avg(comm, *net, {.hooks = hooks});
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  for (int k = 0; k < steps; ++k) {
    const auto [x, y] = batch(comm.rank(), k);
    if (k % 2 == 1)
      for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();  // set_to_none
    else
      opt.zero_grad();
    const auto issued = comm.recent().empty() ? 0 : comm.recent().back().seq + 1;
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    if (hooks) {  // the buckets started during backward, from the hooks
      const auto recent = comm.recent();
      MP_EXPECT(!recent.empty() && recent.back().seq >= issued &&
                    std::string(recent.back().op) == "all_reduce",
                "no bucket started during backward at step " << k);
      avg.synchronize();
    } else {
      avg.average();
    }
    opt.step();
    MP_EXPECT(same_everywhere(comm, state_of(*net)), "replicas differ after step " << k);
  }
  return state_of(*net);
}

}  // namespace

TEST_CASE(
    "GradientAverager over a torch::nn::Module: rank 0's parameters and buffers, identical "
    "replicas, hooks bitwise equal to average() after backward") {
  mp::run(3, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    {
      torch::manual_seed(static_cast<std::uint64_t>(comm.rank()));
      Net net;
      const auto before = state_of(*net);
      const bool same_before = same_everywhere(comm, before);  // (a collective: every rank)
      MP_EXPECT(!same_before, "different initializations");
      ddp::GradientAverager avg(comm, *net);
      MP_EXPECT(same_everywhere(comm, state_of(*net)), "rank 0's parameters and buffers");
      MP_EXPECT(avg.size() == net->parameters().size(), avg.size());
      // Gradients that did not exist were made as zeros (no backward yet).
      for (const auto& p : net->parameters())
        MP_EXPECT(p.grad().defined() && torch::all(p.grad() == 0).item<bool>(), "zero gradient");
    }
    const auto with_hooks = train(comm, true, 4);
    const auto after_backward = train(comm, false, 4);
    MP_EXPECT(torch::equal(with_hooks, after_backward),
              "hooks and average() differ by " << (with_hooks - after_backward).abs().max());
  });
}

TEST_CASE(
    "GradientAverager over a torch::nn::Module: a comm hook for run-time-typed gradients, called "
    "from autograd's hooks, equals the default") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    const auto run = [&](bool hooked, torch::Dtype dtype) {
      torch::manual_seed(3);
      Net net;
      net->to(dtype);
      ddp::GradientAverager avg(comm, *net, {.bucket_bytes = 256, .first_bucket_bytes = 64});
      int calls = 0;
      if (hooked)
        avg.register_comm_hook([&](auto& c, auto& bucket) {  // one hook for every dtype
          ++calls;
          return ddp::allreduce_hook(c, bucket);
        });
      const auto [x, y] = batch(comm.rank(), 0);
      torch::nn::functional::cross_entropy(net->forward(x.to(dtype)), y).backward();
      MP_EXPECT(!hooked || calls > 0, "no bucket started during backward");
      avg.synchronize();
      MP_EXPECT(!hooked || calls == static_cast<int>(avg.buckets().size()), calls << " calls");
      std::vector<torch::Tensor> grads;
      for (const auto& p : net->parameters()) grads.push_back(p.grad().flatten().clone());
      return torch::cat(grads);
    };
    for (const auto dtype : {torch::kFloat, torch::kDouble}) {
      const auto a = run(false, dtype), b = run(true, dtype);
      MP_EXPECT(torch::equal(a, b), "the hook differs by " << (a - b).abs().max());
    }
  });
}

TEST_CASE("GradientAverager over a torch::nn::Module: no_sync accumulation equals one big batch") {
  mp::run(2, ddp::HostTransport::tcp, [](Comm& comm) {
    torch::set_num_threads(1);
    torch::manual_seed(5);
    Net net;
    net->eval();  // BatchNorm with its running statistics: the loss is a sum over samples
    ddp::GradientAverager avg(comm, *net);
    const int micro = 3, p = comm.size();
    const auto loss_of = [&](const torch::Tensor& x, const torch::Tensor& y) {
      return torch::nn::functional::cross_entropy(
          net->forward(x), y,
          torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum));
    };
    for (auto& q : net->parameters()) q.mutable_grad().zero_();
    {
      auto guard = avg.no_sync();
      for (int k = 0; k < micro - 1; ++k) {
        const auto [x, y] = batch(comm.rank(), k);
        loss_of(x, y).backward();
      }
    }
    const auto [x, y] = batch(comm.rank(), micro - 1);
    loss_of(x, y).backward();
    avg.synchronize();
    std::vector<torch::Tensor> got;
    for (const auto& q : net->parameters()) got.push_back(q.grad().clone());
    // The reference: every rank's micro-batches in one process, averaged over ranks.
    for (auto& q : net->parameters()) q.mutable_grad().zero_();
    torch::Tensor total;
    for (int r = 0; r < p; ++r)
      for (int k = 0; k < micro; ++k) {
        const auto [xr, yr] = batch(r, k);
        const auto l = loss_of(xr, yr) / p;
        total = total.defined() ? total + l : l;
      }
    total.backward();
    std::size_t i = 0;
    for (const auto& q : net->parameters()) {
      MP_EXPECT(torch::allclose(got[i], q.grad(), 1e-6, 1e-6),
                "parameter " << i << " differs by " << (got[i] - q.grad()).abs().max());
      ++i;
    }
  });
}

TEST_CASE(
    "GradientAverager over a torch::nn::Module: gradients set to None, a parameter only some ranks "
    "use, with and without hooks") {
  mp::run(3, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    for (const bool hooks : {false, true}) {
      torch::manual_seed(9);
      Net net;
      auto extra = net->register_parameter("extra", torch::ones({5}));  // used by rank 0 only
      ddp::GradientAverager avg(comm, *net, {.hooks = hooks});
      for (int step = 0; step < 3; ++step) {
        for (auto& q : net->parameters()) q.mutable_grad() = torch::Tensor();  // set_to_none
        const auto [x, y] = batch(comm.rank(), step);
        auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
        if (comm.rank() == 0) loss = loss + (extra * 2).sum();
        loss.backward();
        // The gradients are autograd's own: the averager made none of them before backward.
        if (comm.rank() != 0) MP_EXPECT(!extra.grad().defined(), "extra's gradient exists");
        const auto fc1_grad = net->fc1->weight.grad().data_ptr();
        if (hooks)
          avg.synchronize();
        else
          avg.average();
        MP_EXPECT(net->fc1->weight.grad().data_ptr() == fc1_grad, "averaged where autograd put it");
        // Rank 0's gradient 2, averaged over 3 ranks; zeros made where the parameter was unused.
        MP_EXPECT(
            extra.grad().defined() && torch::allclose(extra.grad(), torch::full({5}, 2.0F / 3.0F)),
            "extra's averaged gradient (hooks " << hooks << ", step " << step << ")");
        MP_EXPECT(same_everywhere(comm, net->fc1->weight.grad().flatten()),
                  "fc1's gradient differs between ranks");
      }
    }
  });
}

TEST_CASE("GradientAverager over a torch::nn::Module: a second backward before synchronize()") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    torch::manual_seed(3);
    Net net;
    ddp::GradientAverager avg(comm, *net);
    const auto [x, y] = batch(comm.rank(), 0);
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    std::string what;
    try {  // its accumulation would race the averaging the first one started: refused
      torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    } catch (const std::exception& e) {
      what = e.what();
    }
    MP_EXPECT(what.find("accumulated twice in one step (a second backward before "
                        "synchronize())") != std::string::npos &&
                  what.find("rank " + std::to_string(comm.rank())) != std::string::npos,
              what);
    avg.synchronize();  // the buckets already started still finish
    // Inside no_sync(), several backward passes are what it is for.
    {
      auto guard = avg.no_sync();
      for (int k = 0; k < 2; ++k)
        torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    }
    torch::nn::functional::cross_entropy(net->forward(x), y).backward();
    avg.synchronize();
    MP_EXPECT(same_everywhere(comm, net->fc1->weight.grad().flatten()), "gradients differ");
  });
}

TEST_CASE(
    "GradientAverager over a torch::nn::Module: a backward with create_graph (autograd makes new "
    "gradient tensors) is averaged where the gradients are") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    torch::manual_seed(1);
    torch::nn::Linear fc(8, 8);
    ddp::GradientAverager avg(comm, *fc);
    for (int s = 0; s < 3; ++s) {
      fc->zero_grad();
      const auto x = torch::randn({4, 8}) + static_cast<double>(comm.rank());
      fc(x).pow(2).sum().backward({}, true, true);
      const auto grads = [&] {
        std::vector<torch::Tensor> g;
        for (const auto& p : fc->parameters()) g.push_back(p.grad().detach().flatten());
        return torch::cat(g);
      };
      const auto mine = grads();
      avg.synchronize();
      auto all = torch::empty({comm.size(), mine.numel()});
      comm.all_gather(mine, all);
      const auto want = (all[0] + all[1]) / 2, got = grads();
      MP_EXPECT(torch::allclose(got, want, 1e-6, 1e-6),
                "step " << s << ": the average is off by " << (got - want).abs().max());
    }
  });
}

TEST_CASE("GradientAverager over a torch::nn::Module: refusals") {
  mp::run(2, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    // Different models on different ranks: a mismatch, named, on every rank.
    torch::nn::Linear a(4, comm.rank() == 0 ? 3 : 5);
    try {
      ddp::GradientAverager avg(comm, *a);
      MP_EXPECT(false, "different models were accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::mismatch, e.what());
      MP_EXPECT(std::string(e.what()).find(
                    "parameter 0 has 12 elements on rank 0 but 20 on rank 1") != std::string::npos,
                e.what());
    }
    // Integer parameters have no gradients to average.
    struct Ints : torch::nn::Module {
      Ints() { register_parameter("w", torch::ones({3}, torch::kLong), false); }
    } ints;
    try {
      ddp::GradientAverager avg(comm, ints);
      MP_EXPECT(false, "an int64 model was accepted");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
      MP_EXPECT(std::string(e.what()).find("gradients must be float32") != std::string::npos,
                e.what());
    }
  });
}

TEST_CASE(
    "ShardedAverager over a torch::nn::Module: torch's Adam on the shard (TorchShard) equals Adam "
    "on the whole model, with state for 1/P of it") {
  mp::run(3, ddp::HostTransport::shm, [](Comm& comm) {
    torch::set_num_threads(1);
    const auto adam_state = [](torch::optim::Adam& opt) {
      std::int64_t n = 0;
      for (auto& [key, state] : opt.state())
        n += static_cast<torch::optim::AdamParamState&>(*state).exp_avg().numel();
      return n;
    };
    torch::manual_seed(static_cast<std::uint64_t>(comm.rank()));
    Net full;
    ddp::GradientAverager avg(comm, *full);
    torch::optim::Adam full_opt(full->parameters(), torch::optim::AdamOptions(0.01));
    torch::manual_seed(static_cast<std::uint64_t>(comm.rank() + 7));  // rank 0's copied anyway
    Net net;
    ddp::ShardedAverager zero(
        comm, *net, {.bucket_bytes = 256, .first_bucket_bytes = 64, .in_place_bytes = 128});
    ddp::TorchShard shard(zero);
    torch::optim::Adam opt(shard.parameters(), torch::optim::AdamOptions(0.01));
    {
      torch::NoGradGuard no_grad;  // the same start: the reference takes rank 0's sharded values
      auto src = net->parameters();
      auto dst = full->parameters();
      for (std::size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
      auto bs = net->buffers();
      auto bd = full->buffers();
      for (std::size_t i = 0; i < bs.size(); ++i) bd[i].copy_(bs[i]);
    }
    for (int k = 0; k < 6; ++k) {
      const auto [x, y] = batch(comm.rank(), k);
      full_opt.zero_grad();
      torch::nn::functional::cross_entropy(full->forward(x), y).backward();
      avg.synchronize();
      full_opt.step();

      opt.zero_grad();  // as the documentation's loop: the shard's tensors (step() did the rest)
      torch::nn::functional::cross_entropy(net->forward(x), y).backward();
      shard.step(opt);
      MP_EXPECT(same_everywhere(comm, state_of(*net)), "replicas differ after step " << k);
    }
    const auto a = state_of(*net), b = state_of(*full);
    const double diff = ((a - b).abs() / b.abs().clamp_min(1e-3)).max().item<double>();
    MP_EXPECT(diff <= 1e-6, "sharded Adam differs from Adam by " << diff << " (relative)");
    const auto state = adam_state(opt), whole = adam_state(full_opt);
    MP_EXPECT(state == static_cast<std::int64_t>(zero.shard_size()) &&
                  std::abs(static_cast<double>(state) * comm.size() / static_cast<double>(whole) -
                           1) < 0.05,
              "Adam holds " << state << " moments on this rank, " << whole << " unsharded");
  });
}

// ---- torch state in checkpoints (ddp/adapters/torch_checkpoint.hpp) ----

namespace {

/// Whether `a` and `b` hold the same bytes (NaNs and signed zeros included).
bool bitwise_equal(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const auto ca = a.detach().contiguous(), cb = b.detach().contiguous();
  return ca.nbytes() == cb.nbytes() && std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

/// Expects `call` to fail with Errc::invalid_argument whose message contains `needle`.
template <class F>
void expect_invalid(const std::string& needle, F&& call) {
  try {
    call();
    FAIL_CHECK("accepted; expected an error naming " << needle);
  } catch (const ddp::Error& e) {
    CHECK_MESSAGE(e.code() == ddp::Errc::invalid_argument, e.what());
    CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
  }
}

/// Every parameter and buffer of the model, and every state tensor of the optimizer, bitwise
/// (as bytes), with each group's learning rate.
std::string everything(torch::nn::Module& m, torch::optim::Optimizer& opt) {
  std::string out;
  const auto add = [&](const torch::Tensor& t) {
    const auto c = t.detach().contiguous();
    out.append(static_cast<const char*>(c.data_ptr()), c.nbytes());
  };
  for (const auto& p : m.parameters()) add(p);
  for (const auto& b : m.buffers()) add(b);
  for (const auto& g : opt.param_groups()) {
    out += std::to_string(g.options().get_lr());
    for (const auto& p : g.params()) {
      const auto key = ddp::torch_detail::state_key(opt.state(), p);
      const auto it = opt.state().find(key);
      if (it == opt.state().end()) continue;
      if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
        out += std::to_string(a->step());
        add(a->exp_avg());
        add(a->exp_avg_sq());
      } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
        add(s->momentum_buffer());
      }
    }
  }
  return out;
}

/// In a rank: expects `call` to fail with Errc::invalid_argument whose message contains `needle`.
template <class F>
void refused(const std::string& needle, F&& call) {
  mp::expect_invalid(needle, std::forward<F>(call));
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const std::string& kind,
                                                        std::vector<torch::Tensor> params) {
  if (kind == "Adam")
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01));
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
}

}  // namespace

TEST_CASE("Checkpoint: torch tensors of every dtype, bitwise through a file, and what is refused") {
  torch::manual_seed(3);
  mp::TempDir dir;
  std::vector<std::pair<std::string, torch::Tensor>> cases = {
      {"f32", torch::randn({3, 4})},
      {"f64", torch::randn({5}, torch::kDouble)},
      {"f16", torch::randn({2, 3}).to(torch::kHalf)},
      {"bf16", torch::randn({7}).to(torch::kBFloat16)},
      {"i8", torch::randint(-100, 100, {9}, torch::kChar)},
      {"u8", torch::randint(0, 255, {2, 2, 2}, torch::kByte)},
      {"i16", torch::randint(-1000, 1000, {4}, torch::kShort)},
      {"i32", torch::randint(-100000, 100000, {4}, torch::kInt)},
      {"i64", torch::randint(-100000, 100000, {1, 6}, torch::kLong)},
      {"bool", torch::randint(0, 2, {10}).to(torch::kBool)},
      {"c64", torch::randn({3}, torch::kComplexFloat)},
      {"scalar", torch::tensor(2.5)},
      {"empty", torch::empty({0, 3})},
      {"transposed", torch::randn({3, 5}).t()},  // not contiguous: saved in torch's order
  };
  auto nan = torch::randn({4});
  nan[1] = std::numeric_limits<float>::quiet_NaN();
  nan[2] = -0.0F;
  cases.emplace_back("nan", nan);
  {
    ddp::Checkpoint ck;
    for (const auto& [name, t] : cases) ddp::put_tensor(ck, name, t);
    ck.save(dir.file("t.ckpt"));
  }
  const auto ck = ddp::Checkpoint::load(dir.file("t.ckpt"));
  REQUIRE(ck);
  for (const auto& [name, t] : cases) {
    const auto fresh = ddp::get_tensor(*ck, name);  // a new tensor of the saved dtype and shape
    CHECK_MESSAGE(bitwise_equal(fresh, t), name);
    auto into = torch::full_like(t, 1).contiguous();
    ddp::get_tensor(*ck, name, into);  // into an existing one
    CHECK_MESSAGE(bitwise_equal(into, t), name);
  }
  auto strided = torch::zeros({3, 5}).t();  // into a non-contiguous tensor
  ddp::get_tensor(*ck, "transposed", strided);
  CHECK(bitwise_equal(strided, cases[13].second));

  expect_invalid("holds a tensor Float[3,4], but the tensor given is Half[3,4]", [&] {
    ddp::get_tensor(*ck, "f32", torch::zeros({3, 4}, torch::kHalf));
  });
  expect_invalid("holds a tensor Float[3,4], but the tensor given is Float[4,3]", [&] {
    ddp::get_tensor(*ck, "f32", torch::zeros({4, 3}));
  });
  expect_invalid("an undefined torch::Tensor",
                 [&] { ddp::get_tensor(*ck, "f32", torch::Tensor()); });
  expect_invalid("no section", [&] { (void)ddp::get_tensor(*ck, "absent"); });
  ddp::Checkpoint raw;
  expect_invalid("an undefined torch::Tensor", [&] { ddp::put_tensor(raw, "u", torch::Tensor()); });
  expect_invalid("sparse", [&] { ddp::put_tensor(raw, "s", torch::eye(3).to_sparse()); });
  const std::vector<float> values{1, 2, 3};
  raw.put_values("raw", values);  // bytes alone: read into a tensor of that size
  auto three = torch::zeros({3});
  ddp::get_tensor(raw, "raw", three);
  CHECK(torch::equal(three, torch::tensor({1.0F, 2.0F, 3.0F})));
  expect_invalid("holds 12 bytes, but the tensor given (Float[4]) has 16",
                 [&] { ddp::get_tensor(raw, "raw", torch::zeros({4})); });
  expect_invalid("was not put with put_tensor", [&] { (void)ddp::get_tensor(raw, "raw"); });
  expect_invalid("share memory", [&] {
    ddp::get_tensor(*ck, "f32", torch::zeros({1, 4}).expand({3, 4}));
  });
  const auto meta = torch::empty({3}, torch::TensorOptions().device(torch::kMeta));
  expect_invalid("a meta torch::Tensor", [&] { ddp::put_tensor(raw, "m", meta); });
  // A name too long for the sections made from it: refused before anything is put.
  const auto before = raw.names();
  expect_invalid("(made from the name given) has 4101 bytes",
                 [&] { ddp::put_tensor(raw, std::string(4090, 'x'), torch::zeros({2})); });
  Net net;
  expect_invalid("made from the name given",
                 [&] { ddp::put_module(raw, std::string(4080, 'm'), *net); });
  CHECK(raw.names() == before);
  expect_invalid("holds no module named \"net\" (its modules: none)",
                 [&] { ddp::get_module(raw, "net", *net); });
}

TEST_CASE(
    "Checkpoint: a torch::nn::Module with Adam or SGD saved and loaded across ranks, bitwise: the "
    "run resumed from it equals the run that went on, another model or optimizer refused") {
  mp::TempDir dir;
  for (const std::string kind : {"Adam", "SGD"}) {
    const std::string path = dir.file(kind + ".ckpt");
    std::string saved, straight;  // rank 0's state at the save, and after 6 steps unbroken
    const auto steps = [](Comm& comm, Net& net, auto& avg, torch::optim::Optimizer& opt, int from,
                          int to) {
      for (int k = from; k < to; ++k) {
        const auto [x, y] = batch(comm.rank(), k);
        opt.zero_grad();
        torch::nn::functional::cross_entropy(net->forward(x), y).backward();
        avg.synchronize();
        opt.step();
      }
    };
    mp::run(2, ddp::HostTransport::shm, [&](Comm& comm) {
      torch::set_num_threads(1);
      torch::manual_seed(1);
      Net net;
      ddp::GradientAverager avg(comm, *net);
      auto opt = make_optimizer(kind, net->parameters());
      steps(comm, net, avg, *opt, 0, 3);
      for (const auto& p : net->parameters())  // the state is found where torch keeps it
        MP_EXPECT(opt->state().count(ddp::torch_detail::state_key(opt->state(), p)) == 1,
                  "no state found for a parameter");
      opt->param_groups()[0].options().set_lr(0.02);  // as a schedule would
      ddp::Checkpoint ck;                             // the five lines of the documentation
      ddp::put_module(ck, "model", *net);
      ddp::put_optimizer(ck, "opt", *opt);
      ddp::save_checkpoint(comm, ck, path);
      mp::TempDir::write(path + ".at-save." + std::to_string(comm.rank()), everything(*net, *opt));
      steps(comm, net, avg, *opt, 3, 6);
      mp::TempDir::write(path + ".straight." + std::to_string(comm.rank()), everything(*net, *opt));
    });
    mp::run(2, ddp::HostTransport::shm, [&](Comm& comm) {
      torch::set_num_threads(1);
      torch::manual_seed(99);  // another initialization: everything comes from the checkpoint
      Net net;
      ddp::GradientAverager avg(comm, *net);
      auto opt = make_optimizer(kind, net->parameters());
      auto ck = ddp::load_checkpoint(comm, path);
      MP_EXPECT(ck.has_value(), "no checkpoint");
      ddp::get_module(*ck, "model", *net);
      ddp::get_optimizer(*ck, "opt", *opt);
      {
        const auto a = everything(*net, *opt);
        const auto b = mp::TempDir::read(path + ".at-save." + std::to_string(comm.rank()));
        std::size_t i = 0;
        while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
        MP_EXPECT(a == b, kind << ": the loaded state differs from the saved one: " << a.size()
                               << " " << b.size() << " at " << i);
      }
      MP_EXPECT(opt->param_groups()[0].options().get_lr() == 0.02, "the learning rate");
      steps(comm, net, avg, *opt, 3, 6);
      MP_EXPECT(everything(*net, *opt) ==
                    mp::TempDir::read(path + ".straight." + std::to_string(comm.rank())),
                kind << ": the resumed run differs from the one that went on");

      // Refused, nothing changed: another model, another optimizer's state, other parameters.
      struct OtherImpl : torch::nn::Module {
        OtherImpl() : fc1(register_module("fc1", torch::nn::Linear(8, 17))) {}
        torch::nn::Linear fc1;
      };
      auto other = std::make_shared<OtherImpl>();
      const auto before = other->fc1->weight.clone();
      refused("which this module has not", [&] { ddp::get_module(*ck, "model", *other); });
      struct BiggerImpl : NetImpl {
        BiggerImpl() { register_parameter("extra", torch::zeros({2})); }
      };
      BiggerImpl bigger;
      refused("the module has extra", [&] { ddp::get_module(*ck, "model", bigger); });
      struct WideImpl : torch::nn::Module {  // the same names, another shape
        WideImpl()
            : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
              bn(register_module("bn", torch::nn::BatchNorm1d(16))),
              fc2(register_module("fc2", torch::nn::Linear(16, 5))) {}
        torch::nn::Linear fc1;
        torch::nn::BatchNorm1d bn;
        torch::nn::Linear fc2;
      } wide;
      const auto wide_fc1 = wide.fc1->weight.clone();
      refused("holds a tensor Float[4,16], but the tensor given is Float[5,16]",
              [&] { ddp::get_module(*ck, "model", wide); });
      MP_EXPECT(torch::equal(wide.fc1->weight, wide_fc1), "a refused load changed the module");
      MP_EXPECT(torch::equal(other->fc1->weight, before), "a refused load changed the module");
      auto wrong = make_optimizer(kind == "Adam" ? "SGD" : "Adam", net->parameters());
      refused("the checkpoint holds " + kind + " state, the optimizer given is " +
                  (kind == "Adam" ? "SGD" : "Adam"),
              [&] { ddp::get_optimizer(*ck, "opt", *wrong); });
      torch::optim::AdamW adamw(net->parameters());
      refused("the optimizer given is AdamW", [&] { ddp::get_optimizer(*ck, "opt", adamw); });
      Net twin;  // the same model in double precision: refused before torch's step would fail
      twin->to(torch::kDouble);
      auto doubled = make_optimizer(kind, twin->parameters());
      refused("parameter 0 is Float[16,8] in the checkpoint but Double[16,8] here",
              [&] { ddp::get_optimizer(*ck, "opt", *doubled); });
      refused("holds no optimizer named \"adam\" (its optimizers: \"opt\")",
              [&] { ddp::get_optimizer(*ck, "adam", *opt); });
      // The state is replaced as a whole: a checkpoint of a fresh optimizer leaves none.
      auto fresh = make_optimizer(kind, net->parameters());
      ddp::Checkpoint empty;
      ddp::put_optimizer(empty, "opt", *fresh);
      MP_EXPECT(!opt->state().empty(), "the trained optimizer has state");
      ddp::get_optimizer(empty, "opt", *opt);
      MP_EXPECT(opt->state().empty(), "stale state survived the load: " << opt->state().size());
      auto few = make_optimizer(kind, {net->parameters()[0]});
      refused("over 6 parameters in 1 groups, this one has 1 in 1",
              [&] { ddp::get_optimizer(*ck, "opt", *few); });
    });
  }
}

TEST_CASE(
    "TorchShard: torch's Adam and SGD state saved sharded by 3 ranks, loaded and saved again by "
    "2, loaded by 3: the run goes on bitwise as if never stopped") {
  mp::TempDir dir;
  for (const std::string kind : {"Adam", "SGD"}) {
    const std::string path = dir.file(kind), again = dir.file(kind + "-again");
    const auto run_steps = [](Comm& comm, Net& net, auto& shard, torch::optim::Optimizer& opt,
                              int from, int to) {
      for (int k = from; k < to; ++k) {
        const auto [x, y] = batch(comm.rank(), k);
        opt.zero_grad();
        torch::nn::functional::cross_entropy(net->forward(x), y).backward();
        shard.step(opt);
      }
    };
    const auto save = [](ddp::Checkpoint& state, Net& net, auto& zero, auto& shard,
                         torch::optim::Optimizer& opt, const std::string& to) {
      ddp::put_optimizer(state, "opt", opt, shard);
      ddp::put_buffers(state, "bn", *net);
      zero.save(state, to);
    };
    const auto resume = [](Net& net, auto& zero, auto& shard, torch::optim::Optimizer& opt,
                           const std::string& from) {
      auto st = zero.load(from);
      MP_EXPECT(st.has_value(), "no checkpoint at " << from);
      ddp::get_optimizer(*st, "opt", opt, shard);
      ddp::get_buffers(*st, "bn", *net);
      return st;
    };
    const ddp::BucketOptions small{
        .bucket_bytes = 256, .first_bucket_bytes = 64, .in_place_bytes = 128};
    mp::run(3, ddp::HostTransport::shm, [&](Comm& comm) {
      torch::set_num_threads(1);
      torch::manual_seed(5);
      Net net;
      ddp::ShardedAverager zero(comm, *net, small);
      ddp::TorchShard shard(zero);
      auto opt = make_optimizer(kind, shard.parameters());
      run_steps(comm, net, shard, *opt, 0, 3);
      opt->param_groups()[0].options().set_lr(0.03);
      ddp::Checkpoint state;
      save(state, net, zero, shard, *opt, path);
      run_steps(comm, net, shard, *opt, 3, 6);
      mp::TempDir::write(path + ".straight." + std::to_string(comm.rank()), everything(*net, *opt));
    });
    mp::run(2, ddp::HostTransport::shm, [&](Comm& comm) {  // cut for 2 ranks, and saved again
      torch::set_num_threads(1);
      Net net;
      ddp::ShardedAverager zero(comm, *net, small);
      ddp::TorchShard shard(zero);
      auto opt = make_optimizer(kind, shard.parameters());
      const auto st = resume(net, zero, shard, *opt, path);
      std::int64_t held = 0;
      for (const auto& [key, s] : opt->state()) {
        if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(s.get())) {
          held += a->exp_avg().numel();
          MP_EXPECT(a->step() == 3, "Adam's step " << a->step());
        } else {
          held += static_cast<torch::optim::SGDParamState&>(*s).momentum_buffer().numel();
        }
      }
      MP_EXPECT(held == static_cast<std::int64_t>(zero.shard_size()),
                "state for " << held << " elements, the shard has " << zero.shard_size());
      MP_EXPECT(opt->param_groups()[0].options().get_lr() == 0.03, "the learning rate");
      ddp::Checkpoint state;
      save(state, net, zero, shard, *opt, again);
      // Refused: a checkpoint not cut for this shard, another kind of optimizer.
      auto wrong = make_optimizer(kind == "Adam" ? "SGD" : "Adam", shard.parameters());
      refused("state, the optimizer given is",
              [&] { ddp::get_optimizer(*st, "opt", *wrong, shard); });
      auto whole = make_optimizer(kind, net->parameters());
      refused("the optimizer is not over the shard's tensors",
              [&] { ddp::get_optimizer(*st, "opt", *whole, shard); });
      refused("not over the shard's tensors",
              [&] { ddp::put_optimizer(state, "o", *whole, shard); });
      refused("it was put with a TorchShard", [&] { ddp::get_optimizer(*st, "opt", *opt); });
      torch::optim::LBFGS lbfgs(shard.parameters(), torch::optim::LBFGSOptions(0.1));
      refused("this optimizer is LBFGS", [&] { ddp::put_optimizer(state, "l", lbfgs, shard); });
      auto plain = ddp::load_sharded_checkpoint(comm, path);  // cut evenly, not by the averager
      MP_EXPECT(plain.has_value(), "no set");
      if (*plain->sharded_layout("opt." +
                                 std::string(kind == "Adam" ? "exp_avg" : "momentum_buffer")) !=
          zero.layout())
        refused("is not cut for this rank's shard",
                [&] { ddp::get_optimizer(*plain, "opt", *opt, shard); });
    });
    mp::run(3, ddp::HostTransport::shm, [&](Comm& comm) {
      torch::set_num_threads(1);
      torch::manual_seed(77);
      Net net;
      ddp::ShardedAverager zero(comm, *net, small);
      ddp::TorchShard shard(zero);
      auto opt = make_optimizer(kind, shard.parameters());
      const auto st = resume(net, zero, shard, *opt, again);
      run_steps(comm, net, shard, *opt, 3, 6);
      MP_EXPECT(everything(*net, *opt) ==
                    mp::TempDir::read(path + ".straight." + std::to_string(comm.rank())),
                kind << ": resumed through 2 ranks, the run differs from the one that went on");
    });
  }
}
