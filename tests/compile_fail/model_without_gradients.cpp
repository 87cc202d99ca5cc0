// A model whose parameters have no gradient cannot be given to GradientAverager.
#include <ddp/ddp.hpp>

#include <vector>

struct Weights {
  std::vector<float> value;
#ifndef DDP_COMPILE_FAIL
  std::vector<float> grad;
#endif
};

int main() {
  std::vector<Weights> model(2);
  auto comm = ddp::Communicator<ddp::backend::Host>::init();
  ddp::GradientAverager avg(comm, model);  // error: Weights is not a ddp::Parameter
  avg.average();
}
