// Sharded optimizer state (ZeRO-1/2): each rank keeps Adam's moments for 1/P of the parameters.
// ddp::ShardedAverager reduce-scatters the gradients (each rank receives the average of the part
// it owns), the optimizer updates that part only, and gather() gives every rank every update.
// The optimizer here is ordinary code written for a model (a range of parameters with value and
// grad): it runs unchanged on the shard, which is such a range too.
//
// Every 10 steps the run saves a sharded checkpoint (ShardedAverager::save): each rank writes its
// own file, with its shard of the parameters and of Adam's state; the files are replaced all
// together or not at all. Run it again, with as many ranks or another number, and it resumes
// (ShardedAverager::load cuts the shards again for the new world size).
//
//   ./sharded_adam                  (forks 3 ranks; --ranks N for N)
//   ddprun --nproc-per-node 4 ./sharded_adam
//   ./sharded_adam --checkpoint /tmp/zero.ckpt --steps 30
//   ./sharded_adam --checkpoint /tmp/zero.ckpt --ranks 2   (resumes at step 30 on 2 ranks)
#include <ddp/ddp.hpp>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <vector>

struct Param {
  std::vector<float> value, grad;
};

constexpr int n_in = 32, n_out = 16, batch = 48;

// Adam over any model: a range of parameters with `value` and `grad` (the model's Param with
// std::vectors, or the shard's ddp::ShardSlice<float> with ddp::TensorViews; ddp::view sees both).
// Its state is one value per element of the model, in the model's order: on the shard, in
// shard() order, which is how a sharded checkpoint records it (ShardedAverager::layout()).
struct Adam {
  std::vector<float> m, v;
  int t = 0;
  template <class Model>
  void step(Model&& model) {
    if (m.empty()) {
      std::size_t n = 0;
      for (auto& p : model) n += ddp::view(p.value).size;
      m.assign(n, 0.0f);
      v.assign(n, 0.0f);
    }
    ++t;
    const float c1 = 1 - std::pow(0.9f, static_cast<float>(t));
    const float c2 = 1 - std::pow(0.999f, static_cast<float>(t));
    std::size_t j = 0;  // the element's place in m and v
    for (auto& p : model) {
      float* w = ddp::view(p.value).data;
      const float* g = ddp::view(p.grad).data;
      for (std::size_t k = 0; k < ddp::view(p.value).size; ++k, ++j) {
        m[j] = 0.9f * m[j] + 0.1f * g[k];
        v[j] = 0.999f * v[j] + 0.001f * g[k] * g[k];
        w[k] -= 0.05f * (m[j] / c1) / (std::sqrt(v[j] / c2) + 1e-8f);
      }
    }
  }
  [[nodiscard]] std::size_t values() const { return m.size(); }
};

float feature(int s, int i) {
  return std::sin(0.37f * static_cast<float>(s) + 1.3f * static_cast<float>(i));
}
float target(int s, int o) {
  float y = 0.1f * static_cast<float>(o);
  for (int i = 0; i < n_in; ++i)
    y += std::cos(static_cast<float>(o * n_in + i)) * feature(s, i) / 4;
  return y;
}

// Mean-squared error of y = W x + b over samples [first, first + n); its gradients into `net`.
float backward(std::vector<Param>& net, int first, int n) {
  auto& w = net[0];
  auto& b = net[1];
  std::fill(w.grad.begin(), w.grad.end(), 0.0f);
  std::fill(b.grad.begin(), b.grad.end(), 0.0f);
  float loss = 0;
  for (int s = first; s < first + n; ++s) {
    for (int o = 0; o < n_out; ++o) {
      float y = b.value[static_cast<std::size_t>(o)];
      for (int i = 0; i < n_in; ++i)
        y += w.value[static_cast<std::size_t>(o * n_in + i)] * feature(s, i);
      const float err = y - target(s, o);
      loss += err * err / static_cast<float>(n * n_out);
      b.grad[static_cast<std::size_t>(o)] += 2 * err / static_cast<float>(n * n_out);
      for (int i = 0; i < n_in; ++i)
        w.grad[static_cast<std::size_t>(o * n_in + i)] +=
            2 * err * feature(s, i) / static_cast<float>(n * n_out);
    }
  }
  return loss;
}

void run(ddp::Environment env, const std::string& checkpoint, int steps) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
  std::vector<Param> net{{std::vector<float>(n_in * n_out, 0.0f), std::vector<float>(n_in * n_out)},
                         {std::vector<float>(n_out, 0.0f), std::vector<float>(n_out)}};
  ddp::ShardedAverager zero(comm, net, {.first_bucket_bytes = 1024});  // a few buckets
  Adam adam;
  int first = 0;
  if (!checkpoint.empty()) {
    // Every rank gets its shard of the parameters (put back and gathered) and of Adam's state,
    // from files saved at this world size or any other (the state is cut again for this one).
    if (auto ck = zero.load(checkpoint)) {
      first = ck->get_object<int>("step");
      adam.t = ck->get_object<int>("t");
      adam.m.resize(zero.shard_size());
      adam.v.resize(zero.shard_size());
      ck->get_values("m", std::span(adam.m));
      ck->get_values("v", std::span(adam.v));
      if (comm.rank() == 0) std::printf("resumed at step %d\n", first);
    }
  }
  const int local = batch / comm.size();
  double loss = 0, first_loss = -1;
  for (int step = first; step < steps; ++step) {
    const float mine = backward(net, step * batch + comm.rank() * local, local);
    zero.step([&](auto shard) { adam.step(shard); });  // average, Adam on the shard, gather
    loss = ddp::exact_mean(comm, static_cast<double>(mine), 1);
    if (first_loss < 0) first_loss = loss;
    if (!checkpoint.empty() && (step + 1) % 10 == 0) {
      // Every rank writes its own file (no rank writes the whole model), all or none.
      ddp::Checkpoint state;
      state.put_object("step", step + 1).put_object("t", adam.t);
      state.put_sharded("m", adam.m, zero.layout()).put_sharded("v", adam.v, zero.layout());
      zero.save(state, checkpoint);
    }
  }
  // Adam's state on this rank, against what an unsharded Adam holds.
  const auto held = comm.all_gather_object(adam.values());
  const auto models = comm.all_gather_object(
      std::string(reinterpret_cast<const char*>(net[0].value.data()), net[0].value.size() * 4));
  bool same = true;
  for (const auto& m : models) same = same && m == models[0];
  if (comm.rank() == 0) {
    std::printf("%d ranks, steps %d-%d: loss %.4f -> %.4f\n", comm.size(), first, steps, first_loss,
                loss);
    for (int r = 0; r < comm.size(); ++r)
      std::printf("rank %d: Adam state for %zu of %d values\n", r,
                  held[static_cast<std::size_t>(r)], n_in * n_out + n_out);
    std::printf("every rank holds %s model\n", same ? "the same" : "a DIFFERENT");
  }
}

int main(int argc, char** argv) {
  std::string checkpoint;
  int steps = 60, ranks = 3;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--checkpoint") == 0) checkpoint = argv[i + 1];
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--ranks") == 0) ranks = std::atoi(argv[i + 1]);
  }
  try {
    const auto env = ddp::Environment::detect();
    if (env.launcher == "none")
      ddp::spawn(ranks, [&](ddp::Environment e) { run(e, checkpoint, steps); });
    else
      run(env, checkpoint, steps);
  } catch (const ddp::Error& e) {
    std::fprintf(stderr, "sharded_adam: %s\n", e.what());
    return 1;
  }
}
