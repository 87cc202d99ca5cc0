// Gradient accumulation (DDP's no_sync pattern): several micro-batches per optimizer step, averaged
// across ranks only once (inside no_sync() the averager does nothing; the gradients just add up).
// The result equals one step on the large batch; this program checks it.
#include <ddp/ddp.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

struct Param {
  std::vector<double> value, grad;
};

// d/dw of mean((w x - y)^2) over samples [first, first + n), added to the gradient.
void backward(Param& w, int first, int n, double scale) {
  for (int s = first; s < first + n; ++s) {
    const double x = std::sin(s * 0.1), y = 2.5 * x + std::cos(s * 0.7) * 0.1;
    w.grad[0] += scale * 2 * (w.value[0] * x - y) * x / n;
  }
}

void run(ddp::Environment env) {
  auto comm = ddp::Communicator<ddp::backend::Host>::init(env);
  std::vector<Param> model{{{0.5}, {0.0}}};
  ddp::GradientAverager avg(comm, model);
  constexpr int micro = 4, per_rank = 8;  // 4 micro-batches of 8 samples on each rank
  const int r = comm.rank(), p = comm.size();
  model[0].grad[0] = 0;
  for (int m = 0; m < micro; ++m) {
    const int first = (m * p + r) * per_rank;
    if (m < micro - 1) {
      auto no_sync = avg.no_sync();  // accumulate locally, no communication
      backward(model[0], first, per_rank, 1.0 / micro);
      avg.average();  // ignored inside no_sync
    } else {
      backward(model[0], first, per_rank, 1.0 / micro);
      avg.average();  // the one all_reduce of this step
    }
  }
  // The same gradient from the whole large batch in one process.
  Param big{{0.5}, {0.0}};
  backward(big, 0, micro * p * per_rank, 1.0);
  if (r == 0)
    std::printf("accumulated %.12f, large batch %.12f: %s\n", model[0].grad[0], big.grad[0],
                std::abs(model[0].grad[0] - big.grad[0]) < 1e-12 ? "equal" : "DIFFERENT");
}

int main() {
  const auto env = ddp::Environment::detect();
  if (env.launcher == "none")
    ddp::spawn(2, run);
  else
    run(env);
}
