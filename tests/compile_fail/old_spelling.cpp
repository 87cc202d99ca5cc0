// A renamed public name keeps compiling under its old spelling, and the compiler says what it is
// called now: with -Werror=deprecated-declarations the old spelling is the first error, naming
// the new one.
#include <ddp/ddp.hpp>

int entering_now(const ddp::TrainingState& state) {
#ifdef DDP_COMPILE_FAIL
  return state.joining();
#else
  return state.entering();
#endif
}
