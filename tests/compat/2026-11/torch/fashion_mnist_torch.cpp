// Data-parallel training of a small CNN (or the MLP 784-2048-2048-10) on Fashion-MNIST with
// libtorch and ddp.
//
//   ddprun --standalone --nproc-per-node 4 build/default/examples/fashion_mnist_torch
//   build/default/examples/fashion_mnist_torch --nproc 2     (no launcher: forks 2 ranks itself)
//
// Options: --epochs N (3), --batch N (global batch, 64), --lr X (0.05), --lr-decay X (0.7 per
// epoch), --data DIR (/usr/share/datasets/fashion-mnist, or $FASHION_MNIST_DIR), --cache DIR
// (./fashion-mnist-cache), --limit N (the first N training images), --checkpoint FILE
// (fashion_mnist_torch.ckpt), --nproc N (ranks to fork without a launcher, 2), --model cnn|mlp
// (cnn), --hidden N (the MLP's width, 2048), --hook fp32|bf16|powersgd (fp32: the averages as
// they are; bf16: bfloat16 on the wire; powersgd: ddp::PowerSGDHook), --psgd-rank R (4),
// --psgd-start N (100: steps before PowerSGD starts), --resume (continue after the last epoch's
// checkpoint).
//
// What ddp does here: ZeroFirstGuard (local rank 0 decodes the dataset once), DistributedSampler
// (a new shuffled shard every epoch; the test set in exact mode, every image once, and
// ddp::Metrics for the accuracy), GradientAverager over the torch::nn::Module (rank 0's initial
// parameters everywhere, buckets averaged from autograd hooks while backward runs), and after
// every epoch a ddp::Checkpoint: the module's parameters and buffers by name, the optimizer's
// state (momentum) as the bytes of torch's own archive, and the epoch, saved atomically by rank 0
// (save_checkpoint) and given to every rank by --resume (load_checkpoint). Rank 0 alone prints
// progress.
#include <ddp/adapters/torch.hpp>
#include <ddp/ddp.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <span>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../fashion_mnist_common.hpp"
#include "models.hpp"

namespace {

using torch_models::Cnn;
using torch_models::Mlp;

using fashion_mnist::Config;
using fashion_mnist::Split;

bool g_resume = false;  // --resume

/// A module's parameters and buffers, by name, into `ck` (their bytes), and back: copied into
/// the module's own tensors (which the averager and the optimizer hold).
void put_module(ddp::Checkpoint& ck, torch::nn::Module& m) {
  const auto put = [&](const std::string& name, const torch::Tensor& t) {
    const torch::Tensor c = t.detach().contiguous().cpu();
    ck.put(name, std::span(static_cast<const std::byte*>(c.data_ptr()), c.nbytes()));
  };
  for (const auto& p : m.named_parameters()) put("param." + p.key(), p.value());
  for (const auto& b : m.named_buffers()) put("buffer." + b.key(), b.value());
}
void get_module(const ddp::Checkpoint& ck, torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  const auto get = [&](const std::string& name, torch::Tensor t) {
    const std::span<const std::byte> bytes = ck.get(name);
    if (bytes.size() != t.nbytes() || !t.is_contiguous() || !t.device().is_cpu())
      throw std::invalid_argument("--resume: " + name + " does not fit this model");
    std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  };
  for (const auto& p : m.named_parameters()) get("param." + p.key(), p.value());
  for (const auto& b : m.named_buffers()) get("buffer." + b.key(), b.value());
}

/// What torch writes into an archive (the optimizer's state), as bytes.
template <class T>
std::string archive_bytes(const T& what) {
  torch::serialize::OutputArchive archive;
  what.save(archive);
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}
/// Reads `what` back from such bytes.
template <class T>
void from_archive_bytes(T& what, std::span<const std::byte> bytes) {
  std::istringstream in(std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
  torch::serialize::InputArchive archive;
  archive.load_from(in);
  what.load(archive);
}

/// The images `idx` of `s` as a [n, 1, 28, 28] float tensor, and their labels.
std::pair<torch::Tensor, torch::Tensor> gather(const Split& s, const std::vector<std::size_t>& idx,
                                               std::size_t first, std::size_t count) {
  auto x = torch::empty({static_cast<std::int64_t>(count), 1, 28, 28});
  auto y = torch::empty({static_cast<std::int64_t>(count)}, torch::kLong);
  float* xp = x.data_ptr<float>();
  auto* yp = y.data_ptr<std::int64_t>();
  for (std::size_t b = 0; b < count; ++b) {
    const std::size_t k = idx[first + b];
    std::copy_n(&s.images[k * 784], 784, xp + b * 784);
    yp[b] = s.labels[k];
  }
  return {x, y};
}

struct HookChoice {
  std::string hook = "fp32";
  std::size_t rank = 4, start = 100;
};

template <class Net>
void run(const ddp::Environment& env, const Config& cfg, const char* name, const HookChoice& h) {
  torch::set_num_threads(1);
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
  const int world = comm.size(), rank = comm.rank();
  if (cfg.batch % world != 0)
    throw std::invalid_argument("--batch must be a multiple of the number of ranks");
  const Split train = fashion_mnist::load(comm, cfg.data, cfg.cache, "train-images-idx3-ubyte",
                                          "train-labels-idx1-ubyte");
  const Split test = fashion_mnist::load(comm, cfg.data, cfg.cache, "t10k-images-idx3-ubyte",
                                         "t10k-labels-idx1-ubyte");
  const std::size_t n_train = cfg.limit > 0 ? std::min(cfg.limit, train.size()) : train.size();

  torch::manual_seed(static_cast<std::uint64_t>(rank));  // different on every rank ...
  Net net = [&] {
    if constexpr (std::is_same_v<Net, Mlp>)
      return Mlp(cfg.hidden);
    else
      return Net();
  }();
  ddp::GradientAverager avg(comm, *net);  // ... until the averager copies rank 0's
  ddp::PowerSGDHook powersgd({.rank = h.rank, .start_iter = h.start});
  if (h.hook == "powersgd") avg.register_comm_hook(powersgd);
  if (h.hook == "bf16") avg.register_comm_hook(ddp::bf16_compress_hook);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(cfg.lr).momentum(0.9));
  ddp::DistributedSampler sampler(n_train, world, rank, {.shuffle = true, .seed = 7});
  ddp::DistributedSampler eval(test.size(), world, rank, {.shuffle = false, .exact = true});
  const auto local_batch = static_cast<std::size_t>(cfg.batch / world);
  const ddp::Logger log(rank);  // rank 0 prints
  int first_epoch = 0;
  if (g_resume) {
    if (const auto ck = ddp::load_checkpoint(comm, cfg.checkpoint)) {  // every rank gets it
      if (ck->get_object<std::string>("model") != name)
        throw std::invalid_argument("--resume: " + cfg.checkpoint + " holds another --model");
      get_module(*ck, *net);
      from_archive_bytes(opt, ck->get("optimizer"));
      first_epoch = ck->get_object<int>("epoch");
      log.print("resumed from %s after epoch %d", cfg.checkpoint.c_str(), first_epoch);
    }
  }
  log.print("training %s on %zu images with %d rank%s, global batch %d, %zu test images", name,
            n_train, world, world == 1 ? "" : "s", cfg.batch, test.size());

  for (int epoch = first_epoch; epoch < cfg.epochs; ++epoch) {
    sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    for (auto& group : opt.param_groups())
      static_cast<torch::optim::SGDOptions&>(group.options())
          .lr(cfg.lr * std::pow(cfg.decay, static_cast<double>(epoch)));
    const auto mine = sampler.indices();
    ddp::Progress bar(log, "epoch " + std::to_string(epoch + 1) + "/" + std::to_string(cfg.epochs),
                      mine.size(), world);
    double loss_sum = 0;
    std::size_t seen = 0;
    net->train();
    for (std::size_t first = 0; first < mine.size(); first += local_batch) {
      const std::size_t count = std::min(local_batch, mine.size() - first);
      const auto [x, y] = gather(train, mine, first, count);
      opt.zero_grad();
      const torch::Tensor loss = torch::nn::functional::cross_entropy(net->forward(x), y);
      loss.backward();    // buckets are averaged from the hooks while backward runs
      avg.synchronize();  // gradients hold the average over the global batch
      opt.step();
      loss_sum += loss.item<double>() * static_cast<double>(count);
      seen += count;
      bar.update(seen, {{"loss", loss_sum / static_cast<double>(seen)}});
    }
    bar.finish();
    // Test accuracy: every test image exactly once over the ranks.
    net->eval();
    std::size_t correct = 0;
    const auto part = eval.indices();
    {
      torch::NoGradGuard no_grad;
      for (std::size_t first = 0; first < part.size(); first += 500) {
        const std::size_t count = std::min<std::size_t>(500, part.size() - first);
        const auto [x, y] = gather(test, part, first, count);
        const torch::Tensor logits = net->forward(x);
        correct += static_cast<std::size_t>((logits.argmax(1) == y).sum().item<std::int64_t>());
      }
    }
    const auto [accuracy, train_loss] =
        fashion_mnist::epoch_metrics(comm, correct, part.size(), loss_sum, seen);
    log.print("epoch %d/%d: train loss %.4f, test accuracy %.2f%%", epoch + 1, cfg.epochs,
              train_loss, 100 * accuracy);
    // Collective: rank 0 writes (every rank holds the same module and momentum), atomically.
    ddp::Checkpoint ck;
    ck.put_object("epoch", epoch + 1).put_object("model", std::string(name));
    put_module(ck, *net);
    const std::string optimizer = archive_bytes(opt);
    ck.put_values("optimizer", optimizer);
    ddp::save_checkpoint(comm, ck, cfg.checkpoint);
  }
  if (h.hook == "powersgd") {
    const ddp::PowerSGDStats st = powersgd.stats();
    log.print(
        "PowerSGD rank %zu from step %zu: %.0f of %.0f elements per compressed step "
        "(1/%.1f of fp32's bytes)",
        h.rank, h.start,
        static_cast<double>(st.compressed_sent) /
            static_cast<double>(std::max<std::uint64_t>(1, st.steps - h.start)),
        static_cast<double>(st.compressed_full) /
            static_cast<double>(std::max<std::uint64_t>(1, st.steps - h.start)),
        static_cast<double>(st.compressed_full) /
            static_cast<double>(std::max<std::uint64_t>(1, st.compressed_sent)));
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Config defaults;
    defaults.epochs = 3;
    defaults.lr = 0.05f;
    defaults.checkpoint = "fashion_mnist_torch.ckpt";
    defaults.hidden = 2048;
    std::string model = "cnn";
    HookChoice hook;
    const Config cfg = fashion_mnist::parse(
        argc, argv, defaults, "fashion_mnist_torch.cpp",
        [&](const std::string& option, const std::function<std::string()>& next) {
          if (option == "--resume") {
            g_resume = true;
            return true;
          }
          if (option == "--hook") {
            hook.hook = next();
            if (hook.hook != "fp32" && hook.hook != "bf16" && hook.hook != "powersgd")
              throw std::invalid_argument("--hook must be fp32, bf16 or powersgd");
            return true;
          }
          if (option == "--psgd-rank" || option == "--psgd-start") {
            const long v = std::stol(next());
            if (v < (option == "--psgd-rank" ? 1 : 0))
              throw std::invalid_argument(option + " is out of range");
            (option == "--psgd-rank" ? hook.rank : hook.start) = static_cast<std::size_t>(v);
            return true;
          }
          if (option != "--model") return false;
          model = next();
          if (model != "cnn" && model != "mlp")
            throw std::invalid_argument("--model must be cnn or mlp");
          return true;
        });
    const auto train = [&](const ddp::Environment& e) {
      const std::string mlp =
          "the MLP 784-" + std::to_string(cfg.hidden) + "-" + std::to_string(cfg.hidden) + "-10";
      if (model == "mlp")
        run<Mlp>(e, cfg, mlp.c_str(), hook);
      else
        run<Cnn>(e, cfg, "a CNN", hook);
    };
    const auto env = ddp::Environment::detect();
    if (env.launcher == "none")
      ddp::spawn(cfg.nproc, [&](ddp::Environment e) { train(e); });
    else
      train(env);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist_torch: %s\n", e.what());
    return 1;
  }
}
