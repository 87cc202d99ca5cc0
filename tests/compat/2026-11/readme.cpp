// The README's C++ blocks as they were before the renames of efedc6a (Communicator::join ->
// enter, waiting_to_join -> waiting_to_enter, TrainingState::joining -> entering,
// ElasticOptions::join_wait -> enter_wait), each inside the declarations it assumes: the blocks'
// code token for token (clang-format's layout), `...;` (the README's pseudo-code) written as a
// comment. Compiled, not run, against today's headers (tests/CMakeLists.txt): a program written
// from that README must keep compiling, the renamed names living on as [[deprecated]] spellings.
#include <ddp/ddp.hpp>

#include <chrono>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <vector>

using namespace std::chrono_literals;

namespace readme_2026_11 {

struct Param {
  std::vector<float> value, grad;
};
struct Net {
  std::vector<Param> params;
  std::vector<Param>& parameters() { return params; }
};
struct Dataset {
  std::size_t size() const { return 100; }
};
struct Adam {
  std::vector<float> m, v;
  std::uint64_t t = 0;
  void step(std::span<float>) {}
  template <class Shard>
  void step(Shard&&) {}
};
std::vector<std::vector<std::size_t>> batches(const std::vector<std::size_t>&) { return {}; }
void forward_backward(Net&, const std::vector<std::size_t>&) {}
void forward_backward(Net&, std::span<const std::size_t>, std::size_t) {}
void sgd_step(Net&) {}
void update(Net&) {}

using Comm = ddp::Communicator<ddp::backend::Host>;

void collectives(std::vector<float>& grads, std::vector<float>& mine, std::vector<float>& all,
                 std::vector<float>& in, std::vector<float>& out, std::vector<int>& in_counts,
                 std::vector<int>& out_counts) {
  // README: "The collectives"
  auto comm = ddp::Communicator<ddp::backend::Host>::init();     // Environment::detect(), Options{}
  comm.all_reduce(grads, ddp::ReduceOp::avg);                    // any TensorLike, in place
  ddp::Work w = comm.all_gather_async(mine, all);                // overlaps with your work
  w.wait();                                                      // rethrows a failure
  comm.all_reduce_as<ddp::bfloat16>(grads, ddp::ReduceOp::avg);  // float32 moved as bfloat16
  auto sub = comm.split(comm.rank() % 2);                        // MPI_Comm_split rules
  comm.all_to_all(in, out, in_counts, out_counts);               // split sizes, checked to agree
  comm.monitored_barrier(std::chrono::seconds(30), true);        // names every rank that is missing
}

void data_parallel(Comm& comm, Net& model, Dataset& train, int epochs) {
  // README: "Data-parallel training"
  ddp::DistributedSampler sampler(train.size(), comm.size(), comm.rank(),
                                  {.shuffle = true, .seed = 7});
  ddp::GradientAverager avg(comm, model);  // checks the model on every rank, copies rank 0's values
  for (int epoch = 0; epoch < epochs; ++epoch) {
    sampler.set_epoch(epoch);  // a new order every epoch, the same on every rank
    for (auto batch : batches(sampler.indices())) {
      forward_backward(model, batch);  // call avg.mark_ready(i) as gradient i is final
      avg.synchronize();               // gradients now hold the average over all ranks
      sgd_step(model);
    }
  }
  // README: comm hooks
  int calls = 0;
  avg.register_comm_hook([&](auto& comm, auto& bucket) {  // count, then the default
    ++calls;
    return ddp::allreduce_hook(comm, bucket);
  });
  // README: uneven inputs
  std::vector<std::vector<std::size_t>> my_batches;
  ddp::Join join(comm, {&avg});
  for (auto batch : my_batches) {  // a different number on each rank
    join.step();                   // once per optimizer step, before its backward pass
    forward_backward(model, batch);
    avg.synchronize();  // the mean over the ranks that trained this step
    sgd_step(model);
  }
  join.finish();
}

void checkpoints(Comm& comm, std::vector<float>& w, ddp::DistributedSampler& sampler,
                 std::size_t consumed) {
  // README: checkpoints
  if (auto ck = ddp::load_checkpoint(comm, "run.ckpt")) {
    ck->get_values("w", std::span(w));
    sampler.restore(ck->get_object<ddp::SamplerState>("sampler"));
  }
  // ... after some steps:
  ddp::Checkpoint ck;
  ck.put_values("w", w).put_object("sampler", sampler.state(consumed));
  ddp::save_checkpoint(comm, ck, "run.ckpt");
}

void sharded(Comm& comm, Net& model, std::vector<std::vector<std::size_t>>& batches) {
  // README: ZeRO
  ddp::ShardedAverager zero(comm, model);  // broadcasts rank 0's parameters
  Adam adam;                               // examples/sharded_adam.cpp: m, v per shard element
  for (auto batch : batches) {
    forward_backward(model, batch);                    // zero.mark_ready(i) as gradient i is final
    zero.step([&](auto shard) { adam.step(shard); });  // average, Adam on ~1/P, gather
  }
  ddp::Checkpoint state;  // this rank's: Adam's state for its shard, the step
  state.put_sharded("m", adam.m, zero.layout()).put_sharded("v", adam.v, zero.layout());
  state.put_object("t", adam.t);
  zero.save("run.ckpt", state);              // each rank its file
  if (auto ck = zero.load("run.ckpt"))       // on any number of ranks
    ck->get_values("m", std::span(adam.m));  // (sized zero.shard_size() first)
}

void metrics(Comm& comm, double batch_loss, double batch_size, double correct, double ms,
             int epoch) {
  // README: metrics
  ddp::Metrics m;
  m.mean("loss", batch_loss, batch_size).sum("correct", correct).max("step_ms", ms);
  const ddp::MetricValues r = m.reduce(comm);  // collective; r["loss"], r.format()
  if (comm.rank() == 0) std::printf("epoch %d: %s\n", epoch, r.format().c_str());
}

void elastic(ddp::Environment env, Net& net, ddp::DistributedSampler& sampler, int epochs) {
  // README: fault tolerance in one object
  ddp::Elastic<ddp::backend::Host> job(env);  // init(), or join() if restarted
  job.track_model("net", net).track_sampler("sampler", sampler);
  std::optional<ddp::GradientAverager<Net, ddp::backend::Host>> avg;
  job.on_reset([&](auto& comm) { avg.emplace(comm, net); });  // at the start, after each change
  job.run_epochs(sampler, epochs, /*global batch=*/64, [&](auto&, const ddp::ElasticBatch& b) {
    forward_backward(net, b.indices, b.local_batch);  // this rank's samples of the step
    avg->average();
    update(net);
  });
}

void shrink(Comm& comm, ddp::GradientAverager<Net, ddp::backend::Host>& avg) {
  // README: shrink
  try {
    avg.average();  // a peer died in here
  } catch (const ddp::Error& e) {
    comm = comm.shrink({.wait_for_ranks = 10s});  // every survivor: a communicator of survivors
    // comm.size() is smaller, ranks are renumbered 0..n-1 in their old order,
    // comm.previous_ranks()[r] is rank r's old number, comm.epoch() counts the changes.
  }
}

void training_state(Comm& comm, Net& net, ddp::DistributedSampler& sampler, std::size_t batch) {
  std::uint64_t done = 0, step = 0, steps = 10;
  // README: TrainingState
  ddp::TrainingState state;
  state.track_model("net", net).track_object("done", done).track_sampler("sampler", sampler);
  std::optional<ddp::GradientAverager<Net, ddp::backend::Host>> avg;
  state.start(comm);  // rank 0's state everywhere: commit 0
  avg.emplace(comm, net);
  for (;;) {
    try {
      for (; step < steps; ++step) {
        /* ... */;
        avg->average();
        update(net);
        sampler.advance(batch);
        done = step + 1;
        state.commit(comm);                           // every member finished this step
        if (state.joining() > 0 && state.grow(comm))  // newcomers admitted, state sent
          avg.emplace(comm, net);
      }
      break;
    } catch (const ddp::Error&) {
      comm = comm.shrink();    // the survivors
      state.restore(comm);     // net, done, the sampler: the newest commit,
      avg.emplace(comm, net);  // the epoch's rest dealt over the survivors
      step = done;
    }
  }
  (void)comm.waiting_to_join();  // its count of newcomers then (today waiting_to_enter())
}

void newcomer(ddp::Environment env, ddp::Options options, ddp::TrainingState& state) {
  // README: the newcomer
  // the newcomer: the same program, restarted by ddprun --on-failure rejoin (DDP_REJOIN set)
  auto comm =
      env.rejoin ? Comm::join(env, options, {.ticket = state.ticket()}) : Comm::init(env, options);
  if (env.rejoin)
    state.restore(comm);
  else
    state.start(comm);                                            // then avg.emplace(comm, net)
  ddp::ElasticOptions eo{.join_wait = std::chrono::seconds(30)};  // ElasticOptions of that time
  (void)eo;
}

}  // namespace readme_2026_11

struct FrameworkTensor {
  void* raw_data() const { return nullptr; }
  std::size_t element_count() const { return 0; }
  bool is_double() const { return false; }
  bool is_dense() const { return true; }
  bool is_const() const { return false; }
  bool empty() const { return true; }
};
// README: a run-time-typed tensor
template <>
struct ddp::tensor_traits<FrameworkTensor> {
  static ddp::DynamicView view(const FrameworkTensor& t) {
    return {.data = t.raw_data(),
            .size = t.element_count(),
            .dtype = t.is_double() ? ddp::DType::float64 : ddp::DType::float32,
            .device = ddp::Device::cpu(),
            .contiguous = t.is_dense(),  // refused if false: never read or written wrongly
            .read_only = t.is_const(),   // refused as an output if true
            .problem = t.empty() ? "an empty FrameworkTensor" : nullptr};  // refused, quoted
  }
};

void run_time_typed(ddp::Communicator<ddp::backend::Host>& comm, FrameworkTensor& t) {
  comm.all_reduce(t);
}

int main() {}  // built to link, not run: the functions above hold the blocks
