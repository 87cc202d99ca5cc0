// The other unit of the mixed program (mixed_trainer.cpp): compiled with
// DDP_SEPARATE_COMPILATION, it uses ddp itself and the trainer through plain functions.
#include <ddp/ddp.hpp>

#include <cstdio>
#include <exception>

struct Trainer;
Trainer* make_trainer();
float sum_of_twos(Trainer* t);

int main() {
  ddp::TimelineSpan span("step");  // this unit's own use of ddp
  try {
    Trainer* t = make_trainer();
    std::printf("ran with two copies of ddp: %g\n", double(sum_of_twos(t)));
    return 0;
  } catch (const std::exception& e) {  // the header-only copy's ddp::Error: another type here
    std::printf("%s\n", e.what());
    return 3;
  }
}
