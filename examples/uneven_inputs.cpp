// Uneven inputs: ranks hold different numbers of batches (here 3, 6 and 9 of 10 samples), as
// when a dataset does not split evenly or ranks filter their data. Without a Join the rank that
// runs out first stops answering the others' gradient all_reduces, and they wait until their
// timeout. In a ddp::Join it keeps answering with zeros, and each step's average is over the
// ranks that trained it. Every rank ends with the same model; this program checks it.
#include <ddp/ddp.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

struct Param {
  std::vector<double> value, grad;
};

// d/dw of mean((w x - y)^2) over the batch of samples [first, first + n): y = 2.5 x + noise.
void backward(Param& w, int first, int n) {
  w.grad[0] = 0;
  for (int s = first; s < first + n; ++s) {
    const double x = std::sin(s * 0.37), y = 2.5 * x + std::cos(s * 1.3) * 0.01;
    w.grad[0] += 2 * (w.value[0] * x - y) * x / n;
  }
}

void run(ddp::Environment env) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
  std::vector<Param> model{{{0.0}, {0.0}}};
  ddp::GradientAverager avg(comm, model);
  const int r = comm.rank(), batches = 3 * (r + 1);  // 3, 6, 9, ...: uneven
  ddp::Join join(comm, {&avg});
  for (int b = 0; b < batches; ++b) {
    const int active = join.step();  // how many ranks still have data this step
    backward(model[0], (r * 100 + b) * 10, 10);
    avg.average();  // the mean gradient over those `active` ranks
    model[0].value[0] -= 0.5 * model[0].grad[0];
    (void)active;
  }
  join.finish();  // answers the others until every rank is done
  const auto all = comm.all_gather_object(model[0].value[0]);
  bool same = true;
  for (double w : all) same = same && w == model[0].value[0];
  const ddp::Logger log(r);
  log.print("rank 0 trained %zu steps and answered %zu more; w = %.2f, %s on every rank",
            join.steps(), join.shadowed(), model[0].value[0], same ? "the same" : "DIFFERENT");
}

int main() {
  const auto env = ddp::Environment::detect();
  if (env.launcher == "none")
    ddp::spawn(3, run);
  else
    run(env);
}
