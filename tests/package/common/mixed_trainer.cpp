// A unit of a program whose units meet only through the program's own type: a trainer that holds
// a ddp::Communicator, behind functions with no ddp type in their signatures. Built header-only
// while mixed_main.cpp is built with DDP_SEPARATE_COMPILATION, the two link (no ddp symbol
// crosses), so ddp refuses at init() instead of running two copies of its state.
#include <ddp/ddp.hpp>

#include <vector>

struct Trainer {
  ddp::Communicator<ddp::backend::Host> comm = ddp::Communicator<ddp::backend::Host>::init();
};

Trainer* make_trainer() { return new Trainer; }

float sum_of_twos(Trainer* t) {
  std::vector<float> v(3, 2.0f);
  t->comm.all_reduce(v);
  return v[0];
}
