// The main job, fault-tolerant: the Fashion-MNIST MLP of fashion_mnist.cpp, trained so that ranks
// may die during the run while the others go on, from the last step every rank finished, with
// the rest of the epoch's images dealt over them: no step lost, none applied twice, every image
// of every epoch trained on exactly once.
//
//   ddprun --standalone --nproc-per-node 4 --on-failure shrink
//          build/default/examples/fashion_mnist_elastic --kill 1:0:200 --kill 3:1:50
//   ddprun --standalone --nproc-per-node 4 --on-failure rejoin --max-restarts 1
//          build/default/examples/fashion_mnist_elastic --kill 1:0:200 --kill 1:1:50:1
//   (one command line each; in the second, rank 1 dies, is restarted, rejoins, and dies again)
//
// Options: those of fashion_mnist (--epochs, --batch: the global batch, kept when the number of
// ranks changes by giving each rank an equal share, --lr, --lr-decay, --hidden, --data, --cache,
// --limit, --nproc), plus --kill R:E:S[:L] (the process of world rank R dies at step S of epoch
// E, in its life L: 0 as first started, 1 after its first restart to rejoin; repeatable),
// --record DIR (each process writes the images of its committed steps to DIR/rank<R>.txt,
// "epoch image" per line, for counting) and --timing (wall-clock times of a kill and of the
// first step completed after it, for bench/recovery).
//
// What ddp does here, beyond fashion_mnist.cpp:
//  * TrainingState: the model, the epoch and the sampler's place, committed after every step
//    (commit: every rank finished the step); after a loss, restore() gives every survivor the
//    newest commit, bitwise, and deals the epoch's remaining images over the survivors.
//  * Communicator::shrink: the survivors agree on who is alive and form a smaller communicator
//    (ranks renumbered).
//  * Communicator::join and TrainingState::grow: a process that ddprun restarted (DDP_REJOIN)
//    asks to join; after the next commit the members admit it and send it the live state (no
//    checkpoint read); the epoch's remaining images are dealt over the grown world.
//  * After each change of membership, the GradientAverager is made again over the new
//    communicator (its constructor is collective, and a newcomer makes its own then).
//  * DistributedSampler in exact mode: every image once per epoch, however the world changes.

#include <ddp/ddp.hpp>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fashion_mnist_common.hpp"

namespace {

struct Kill {
  int rank, epoch;
  std::size_t step;
  int life;
};
std::vector<Kill> cfg_kills;  // --kill
std::string cfg_record;       // --record
bool cfg_timing = false;      // --timing

/// Wall-clock nanoseconds (comparable across processes), for --timing.
long long wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void run(ddp::Environment env, const fashion_mnist::Config& cfg) {
  using Comm = ddp::Communicator<ddp::backend::Host>;
  const char* rejoins = std::getenv("DDP_REJOIN");
  const int life = env.rejoin && rejoins != nullptr ? std::atoi(rejoins) : 0;
  // A restarted process reads the images from the cache the job made (no collective: the
  // others are training); the others fill it together.
  std::optional<Comm> comm;
  if (!env.rejoin) comm.emplace(Comm::init(env));
  const auto load = [&](const char* images, const char* labels) {
    return comm ? fashion_mnist::load(*comm, cfg.data, cfg.cache, images, labels)
                : fashion_mnist::load(cfg.data, cfg.cache, images, labels);
  };
  const fashion_mnist::Split train = load("train-images-idx3-ubyte", "train-labels-idx1-ubyte");
  const fashion_mnist::Split test = load("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte");
  const std::size_t n_train = cfg.limit > 0 ? std::min(cfg.limit, train.size()) : train.size();
  // The global batch stays about --batch however many ranks there are: each takes an equal
  // share, rounded up (64 over 3 ranks: 22 each).
  const auto local_batch_of = [&](int ranks) {
    return (static_cast<std::size_t>(cfg.batch) + static_cast<std::size_t>(ranks) - 1) /
           static_cast<std::size_t>(ranks);
  };

  fashion_mnist::Mlp model(cfg.hidden);
  ddp::DistributedSampler sampler(n_train, env.world_size, env.rank,
                                  {.shuffle = true, .seed = 7, .exact = true});
  int epoch = 0;
  ddp::TrainingState state;
  state.track_model("model", model).track_object("epoch", epoch).track_sampler("sampler", sampler);
  std::optional<ddp::GradientAverager<fashion_mnist::Mlp, ddp::backend::Host>> avg;
  if (env.rejoin) {
    comm.emplace(Comm::join(env, {}, {.ticket = state.ticket()}));
    state.restore(*comm);  // the members' last commit, from one of them
    std::printf("world rank %d rejoined the job as rank %d of %d at commit %llu, epoch %d\n",
                env.rank, comm->rank(), comm->size(),
                static_cast<unsigned long long>(state.steps()), epoch + 1);
    std::fflush(stdout);
  } else {
    if (cfg.batch % comm->size() != 0)
      throw std::invalid_argument("--batch must be a multiple of the number of ranks");
    state.start(*comm);
  }
  avg.emplace(*comm, model);
  std::ofstream record;
  if (!cfg_record.empty())
    record.open(cfg_record + "/rank" + std::to_string(env.rank) + ".txt", std::ios::app);
  std::string pending;  // this step's images, recorded once the step is committed
  std::uint64_t pending_commit = 0;
  const auto H = static_cast<std::size_t>(cfg.hidden);
  std::vector<float> h(H), dh(H), z(10);
  double loss_sum = 0;
  std::size_t seen = 0;
  bool first_after_loss = false;  // --timing: report the first step after a loss
  for (;;) {
    try {
      while (epoch < cfg.epochs) {
        const ddp::Logger log(comm->rank());
        const float lr = cfg.lr * std::pow(cfg.decay, static_cast<float>(epoch));
        // The ranks step together: as many steps as the longest shard needs (exact-mode shards
        // differ by at most one image; a rank out of images adds a zero gradient).
        const auto mine = sampler.indices();
        const std::size_t ranks = static_cast<std::size_t>(comm->size());
        const std::size_t longest = (sampler.total_size() + ranks - 1) / ranks;
        const std::size_t at = sampler.state().offset;
        const std::size_t local_batch = local_batch_of(comm->size());
        bool regrouped = false;  // new members joined: the epoch's rest is dealt again
        for (std::size_t done = 0; at + done < longest && !regrouped; done += local_batch) {
          for (const Kill& k : cfg_kills) {
            if (k.rank == env.rank && k.life == life && k.epoch == epoch &&
                (at + done) / local_batch >= k.step) {
              std::fprintf(stderr, "rank %d (world rank %d) dies on purpose at epoch %d step %zu\n",
                           comm->rank(), env.rank, epoch, (at + done) / local_batch);
              if (cfg_timing) std::fprintf(stderr, "timing: killed at %lld\n", wall_ns());
              std::_Exit(9);
            }
          }
          const std::size_t count =
              done < mine.size() ? std::min(local_batch, mine.size() - done) : 0;
          loss_sum += fashion_mnist::backward_batch(model, *avg, train, mine.data() + done, count,
                                                    h, dh, z, local_batch);
          avg->synchronize();  // the average over every rank's batch
          for (auto& p : model.params)
            for (std::size_t k = 0; k < p.value.size(); ++k) p.value[k] -= lr * p.grad[k];
          seen += count;
          sampler.advance(count);
          pending.clear();
          for (std::size_t b = 0; b < count; ++b)
            pending += std::to_string(epoch) + " " + std::to_string(mine[done + b]) + "\n";
          pending_commit = state.steps() + 1;
          state.commit(*comm);  // every rank finished this step
          record << pending << std::flush;
          pending.clear();
          if (state.joining() > 0 && state.grow(*comm)) {  // newcomers admitted, state sent
            avg.emplace(*comm, model);
            regrouped = true;
            ddp::Logger(comm->rank())
                .print("admitted newcomers: %d ranks go on from commit %llu", comm->size(),
                       static_cast<unsigned long long>(state.steps()));
          }
          if (first_after_loss && comm->rank() == 0) {
            std::printf("timing: first step on the new membership done at %lld (commit %llu)\n",
                        wall_ns(), static_cast<unsigned long long>(state.steps()));
            std::fflush(stdout);
          }
          first_after_loss = false;
        }
        if (regrouped) continue;
        ddp::DistributedSampler eval(test.size(), comm->size(), comm->rank(),
                                     {.shuffle = false, .exact = true});
        const auto [accuracy, train_loss] =
            fashion_mnist::evaluate(*comm, model, test, eval, loss_sum, seen);
        log.print("epoch %d/%d: train loss %.4f, test accuracy %.2f%% (%d ranks)", epoch + 1,
                  cfg.epochs, train_loss, 100 * accuracy, comm->size());
        loss_sum = 0;
        seen = 0;
        ++epoch;
        sampler.set_epoch(static_cast<std::uint64_t>(epoch));
        state.commit(*comm);
      }
      break;
    } catch (const ddp::Error& e) {
      if (e.code() != ddp::Errc::peer_lost && e.code() != ddp::Errc::aborted &&
          e.code() != ddp::Errc::timeout)
        throw;
      const auto t0 = std::chrono::steady_clock::now();
      *comm = comm->shrink();  // the survivors, ranks renumbered
      const std::uint64_t restored = state.restore(*comm);
      avg.emplace(*comm, model);
      if (restored == pending_commit) record << pending << std::flush;  // rolled forward
      pending.clear();
      first_after_loss = cfg_timing;
      const double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      ddp::Logger(comm->rank())
          .print("lost a rank (%s); %d ranks go on from commit %llu, epoch %d, after %.1f ms",
                 ddp::to_string(e.code()).data(), comm->size(),
                 static_cast<unsigned long long>(restored), epoch + 1, ms);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    fashion_mnist::Config defaults;
    defaults.nproc = 4;
    const fashion_mnist::Config cfg = fashion_mnist::parse(
        argc, argv, defaults, "fashion_mnist_elastic.cpp",
        [](const std::string& a, const std::function<std::string()>& next) {
          if (a == "--kill") {
            Kill k{};
            if (std::sscanf(next().c_str(), "%d:%d:%zu:%d", &k.rank, &k.epoch, &k.step, &k.life) <
                3)
              throw std::invalid_argument("--kill takes RANK:EPOCH:STEP[:LIFE]");
            cfg_kills.push_back(k);
          } else if (a == "--record") {
            cfg_record = next();
          } else if (a == "--timing") {
            cfg_timing = true;
          } else {
            return false;
          }
          return true;
        });
    const auto env = ddp::Environment::detect();
    if (env.launcher == "none") {
      ddp::SpawnOptions so;
      so.stop_on_failure = false;  // the others go on without a rank that fails
      ddp::spawn(
          cfg.nproc, [&](ddp::Environment e) { run(e, cfg); }, so);
    } else {
      run(env, cfg);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fashion_mnist_elastic: %s\n", e.what());
    return 1;
  }
}
