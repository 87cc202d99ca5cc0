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
// --stop R:E:S[:L] (the same, stopping with SIGSTOP instead: the others go on after a heartbeat,
// and the process, continued, finds itself fenced), --record DIR (each process writes the images of
// its committed steps to DIR/rank<R>.txt, "epoch image" per line, for counting) and --timing
// (wall-clock times of a kill and of the first step completed after it, for bench/recovery).
//
// What ddp does here, beyond fashion_mnist.cpp, all through one ddp::Elastic:
//  * the model and the sampler's place are tracked and committed after every step (every rank
//    finished it); after a loss the survivors shrink the communicator, every one gets the newest
//    commit, bitwise, and the epoch's remaining images are dealt over them;
//  * a process that ddprun restarted (DDP_REJOIN) joins the running job: the members admit it
//    after their next commit and send it the live state (no checkpoint read);
//  * after each change the GradientAverager is made again (on_reset), and every rank takes as
//    many steps as the longest shard needs, so the ranks stay in step;
//  * DistributedSampler in exact mode: every image once per epoch, however the world changes.

#include <ddp/ddp.hpp>

#include <signal.h>
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
std::vector<Kill> cfg_stops;  // --stop
std::string cfg_record;       // --record
bool cfg_timing = false;      // --timing

/// Wall-clock nanoseconds (comparable across processes), for --timing.
long long wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void run(ddp::Environment env, const fashion_mnist::Config& cfg) {
  using Host = ddp::backend::Host;
  if (cfg_timing && env.rejoin) std::printf("timing: started at %lld\n", wall_ns());
  const char* rejoins = std::getenv("DDP_REJOIN");
  const int life = env.rejoin && rejoins != nullptr ? std::atoi(rejoins) : 0;
  fashion_mnist::Mlp model(cfg.hidden);
  const auto load = [&](ddp::Communicator<Host>* comm, const char* images, const char* labels) {
    return comm ? fashion_mnist::load(*comm, cfg.data, cfg.cache, images, labels)
                : fashion_mnist::load(cfg.data, cfg.cache, images, labels);
  };
  // The state that survives a loss, and what is made again after each change.
  ddp::Elastic<Host> job(env);
  constexpr std::size_t train_images = 60000;  // Fashion-MNIST's training set
  ddp::DistributedSampler sampler(cfg.limit > 0 ? std::min(cfg.limit, train_images) : train_images,
                                  env.world_size, env.rank,
                                  {.shuffle = true, .seed = 7, .exact = true});
  job.track_model("model", model).track_sampler("sampler", sampler);
  std::optional<ddp::GradientAverager<fashion_mnist::Mlp, Host>> avg;
  job.on_reset([&](ddp::Communicator<Host>& comm) { avg.emplace(comm, model); });
  // A restarted process reads the images from the cache the job made (no collective: the others
  // are training) before it joins; the others fill it together.
  ddp::Communicator<Host>* first = env.rejoin ? nullptr : &job.comm();
  const fashion_mnist::Split train =
      load(first, "train-images-idx3-ubyte", "train-labels-idx1-ubyte");
  const fashion_mnist::Split test = load(first, "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte");
  if (train.size() != train_images) throw std::runtime_error("not Fashion-MNIST's training set");
  if (!env.rejoin && cfg.batch % job.comm().size() != 0)
    throw std::invalid_argument("--batch must be a multiple of the number of ranks");

  // Logging, --record and --timing: what the job does, not how it recovers.
  std::ofstream record;
  if (!cfg_record.empty())
    record.open(cfg_record + "/rank" + std::to_string(env.rank) + ".txt", std::ios::app);
  std::string pending;  // this step's images, recorded once the step is committed
  bool after_loss = false;
  bool newcomer = cfg_timing && env.rejoin;
  job.on_commit([&](ddp::Communicator<Host>& comm, std::uint64_t) {
    record << pending << std::flush;
    pending.clear();
    if (newcomer) std::printf("timing: newcomer's first step done at %lld\n", wall_ns());
    newcomer = false;
    if (after_loss && comm.rank() == 0)
      std::printf("timing: first step on the new membership done at %lld\n", wall_ns());
    std::fflush(stdout);
    after_loss = false;
  });
  job.on_change([&](const ddp::ElasticChange& c) {
    using K = ddp::ElasticChange::Kind;
    const ddp::Logger log(job.comm().rank());
    if (c.kind == K::joined)
      std::printf("world rank %d rejoined the job as rank %d of %d at commit %llu, epoch %d\n",
                  env.rank, job.comm().rank(), c.size, static_cast<unsigned long long>(c.commit),
                  job.epoch() + 1);
    else if (c.kind == K::grew)
      log.print("admitted newcomers: %d ranks go on from commit %llu", c.size,
                static_cast<unsigned long long>(c.commit));
    else if (c.kind == K::lost)
      log.print("lost a rank; %d ranks go on from commit %llu, epoch %d, after %.1f ms", c.size,
                static_cast<unsigned long long>(c.commit), job.epoch() + 1, c.ms);
    std::fflush(stdout);
    after_loss = cfg_timing && c.kind == K::lost;
    pending.clear();  // a step that did not commit is trained again
  });

  const auto H = static_cast<std::size_t>(cfg.hidden);
  std::vector<float> h(H), dh(H), z(10);
  double loss_sum = 0;
  std::size_t seen = 0;
  job.run_epochs(
      sampler, cfg.epochs, static_cast<std::size_t>(cfg.batch),
      [&](ddp::Communicator<Host>& comm, const ddp::ElasticBatch& b) {
        for (const Kill& k : cfg_kills) {
          if (k.rank == env.rank && k.life == life && k.epoch == b.epoch && b.step >= k.step) {
            std::fprintf(stderr, "rank %d (world rank %d) dies on purpose at epoch %d step %zu\n",
                         comm.rank(), env.rank, b.epoch, b.step);
            if (cfg_timing) std::fprintf(stderr, "timing: killed at %lld\n", wall_ns());
            std::_Exit(9);
          }
        }
        for (Kill& k : cfg_stops) {
          if (k.rank == env.rank && k.life == life && k.epoch == b.epoch && b.step >= k.step) {
            std::fprintf(stderr,
                         "rank %d (world rank %d) stops itself (SIGSTOP) at epoch %d step %zu, "
                         "pid %d\n",
                         comm.rank(), env.rank, b.epoch, b.step, static_cast<int>(::getpid()));
            if (cfg_timing) std::fprintf(stderr, "timing: stopped at %lld\n", wall_ns());
            k.rank = -1;       // once
            ::raise(SIGSTOP);  // continued: its next call finds it fenced
          }
        }
        const float lr = cfg.lr * std::pow(cfg.decay, static_cast<float>(b.epoch));
        loss_sum += fashion_mnist::backward_batch(model, *avg, train, b.indices.data(),
                                                  b.indices.size(), h, dh, z, b.local_batch);
        avg->synchronize();  // the average over every rank's batch
        for (auto& p : model.params)
          for (std::size_t k = 0; k < p.value.size(); ++k) p.value[k] -= lr * p.grad[k];
        seen += b.indices.size();
        for (const std::size_t i : b.indices)
          pending += std::to_string(b.epoch) + " " + std::to_string(i) + "\n";
      },
      [&](ddp::Communicator<Host>& comm, int epoch) {
        ddp::DistributedSampler eval(test.size(), comm.size(), comm.rank(),
                                     {.shuffle = false, .exact = true});
        const auto [accuracy, train_loss] =
            fashion_mnist::evaluate(comm, model, test, eval, loss_sum, seen);
        ddp::Logger(comm.rank())
            .print("epoch %d/%d: train loss %.4f, test accuracy %.2f%% (%d ranks)", epoch + 1,
                   cfg.epochs, train_loss, 100 * accuracy, comm.size());
        loss_sum = 0;
        seen = 0;
      });
}

}  // namespace

int main(int argc, char** argv) {
  try {
    fashion_mnist::Config defaults;
    defaults.nproc = 4;
    const fashion_mnist::Config cfg =
        fashion_mnist::parse(argc, argv, defaults, "fashion_mnist_elastic.cpp",
                             [](const std::string& a, const std::function<std::string()>& next) {
                               if (a == "--kill" || a == "--stop") {
                                 Kill k{};
                                 if (std::sscanf(next().c_str(), "%d:%d:%zu:%d", &k.rank, &k.epoch,
                                                 &k.step, &k.life) < 3)
                                   throw std::invalid_argument(a + " takes RANK:EPOCH:STEP[:LIFE]");
                                 (a == "--kill" ? cfg_kills : cfg_stops).push_back(k);
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
