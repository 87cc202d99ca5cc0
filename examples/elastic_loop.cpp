// The guide's fault-tolerant loop (docs/guide/fault_tolerance.md), whole: a linear model
// y = w x + b fitted to y = 3 x - 2 by 4 data-parallel ranks under ddp::Elastic. Rank 2 dies at its
// 30th step; the three others go on from the last step every rank finished, the rest of each epoch
// dealt over them, and end where an uninterrupted run would (w = 3.00, b = -2.00).
//
//   build/default/examples/elastic_loop                  (forks 4 ranks: ddp::spawn)
//   ddprun --standalone --nproc-per-node 4 --on-failure shrink build/default/examples/elastic_loop

#include <ddp/ddp.hpp>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <vector>

namespace {

struct Param {
  std::vector<float> value, grad;
};
struct Net {
  std::vector<Param> params{{{0.0f}, {0.0f}}, {{0.0f}, {0.0f}}};  // w, b
  std::vector<Param>& parameters() { return params; }
};

constexpr std::size_t samples = 1000;
float x_of(std::size_t i) { return static_cast<float>(i) / static_cast<float>(samples); }

int my_rank = 0;  // world rank: who dies, for the demonstration
int my_steps = 0;

/// The gradients of the squared error over this rank's samples of the step, divided by its full
/// share of the batch.
void forward_backward(Net& net, std::span<const std::size_t> batch, std::size_t local_batch) {
  if (my_rank == 2 && ++my_steps == 30) std::_Exit(9);  // a rank lost mid-epoch
  float gw = 0, gb = 0;
  for (const std::size_t i : batch) {
    const float x = x_of(i),
                err = net.params[0].value[0] * x + net.params[1].value[0] - (3 * x - 2);
    gw += 2 * err * x;
    gb += 2 * err;
  }
  net.params[0].grad[0] = gw / static_cast<float>(local_batch);
  net.params[1].grad[0] = gb / static_cast<float>(local_batch);
}

void update(Net& net) {
  for (auto& p : net.params) p.value[0] -= 0.5f * p.grad[0];
}

void train(ddp::Environment env) {
  my_rank = env.rank;
  Net net;
  ddp::DistributedSampler sampler(samples, env.world_size, env.rank,
                                  {.shuffle = true, .seed = 1, .exact = true});
  const int epochs = 40;
  // README begin
  ddp::Elastic<ddp::backend::Host> job(env);  // init(), or enter() if restarted
  job.track_model("net", net).track_sampler("sampler", sampler);
  std::optional<ddp::GradientAverager<Net, ddp::backend::Host>> avg;
  job.on_reset([&](auto& comm) { avg.emplace(comm, net); });  // at the start, after each change
  job.run_epochs(sampler, epochs, /*global batch=*/64, [&](auto&, const ddp::ElasticBatch& b) {
    forward_backward(net, b.indices, b.local_batch);  // this rank's samples of the step
    avg->average();
    update(net);
  });
  // README end
  if (job.comm().rank() == 0)
    std::printf("w = %.2f, b = %.2f on %d ranks after %d loss(es)\n", net.params[0].value[0],
                net.params[1].value[0], job.comm().size(), job.recoveries());
}

}  // namespace

int main() {
  const auto env = ddp::Environment::detect();
  if (env.launcher != "none") {
    train(env);
    return 0;
  }
  ddp::SpawnOptions so;
  so.stop_on_failure = false;  // the others go on without a rank that dies
  try {
    ddp::spawn(4, train, so);
  } catch (const ddp::Error& e) {  // rank 2, on purpose
    std::printf("lost on purpose: %s\n", e.what());
  }
}
