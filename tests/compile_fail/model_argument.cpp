// A model an averager cannot take: the first error the compiler prints says what to change (the
// parameters need a value and a grad, or ddp::parameter_traits; pass *model, not a pointer to it;
// a range of parameters), not 50 lines of unsatisfied constraints. Built once per CASE.
#include <ddp/ddp.hpp>

#include <memory>
#include <vector>

struct Weights {  // CASE 1: no grad
  std::vector<float> value;
#if !defined(DDP_COMPILE_FAIL) || CASE != 1
  std::vector<float> grad;
#endif
};

int main() {
  auto comm = ddp::Communicator<ddp::backend::Host>::init();
#if defined(DDP_COMPILE_FAIL) && CASE == 2
  auto model = std::make_shared<std::vector<Weights> >(2);
  ddp::GradientAverager avg(comm, model);
#elif defined(DDP_COMPILE_FAIL) && CASE == 3
  Weights model;
  ddp::ShardedAverager zero(comm, model);
#else
  auto model = std::make_shared<std::vector<Weights> >(2);
  ddp::GradientAverager avg(comm, *model);
  avg.average();
  ddp::ShardedAverager zero(comm, *model);
#endif
}
