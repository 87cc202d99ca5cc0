// A type a collective cannot take: the first error the compiler prints says which problem it is
// (not contiguous, no tensor_traits, an element type ddp does not carry, a proxy range, const
// where the collective writes), not "no matching function" and a page of constraints.
// Built once per CASE; each case pins its own first error line.
#include <ddp/ddp.hpp>

#include <complex>
#include <cstdint>
#include <deque>
#include <list>
#include <vector>

struct Gradients {  // a user's type without ddp::tensor_traits
  float values[4];
};

void step(ddp::Communicator<ddp::backend::Host>& comm) {
#ifdef DDP_COMPILE_FAIL
#if CASE == 1
  std::list<float> grads(4);
  comm.all_reduce(grads);
#elif CASE == 2
  std::deque<double> grads(4);
  comm.broadcast(grads, 0);
#elif CASE == 3
  Gradients grads{};
  comm.all_reduce(grads);
#elif CASE == 4
  std::vector<bool> flags(4);
  comm.all_reduce(flags);
#elif CASE == 5
  std::vector<std::complex<float> > field(4);
  comm.all_reduce(field);
#elif CASE == 6
  std::vector<long double> sums(4);
  std::vector<long double> all(4 * 2);
  comm.all_gather(sums, all);
#elif CASE == 7
  const std::vector<float> weights(4);
  comm.broadcast(weights, 0);
#elif CASE == 8
  std::vector<std::vector<float> > layers(3, std::vector<float>(4));
  comm.all_reduce(layers);
#elif CASE == 9  // torch's order with the roles named: the output first
  std::vector<float> mine(4), all(8);
  comm.all_gather(ddp::into(all), ddp::from(mine));
#elif CASE == 10
  std::vector<float> in(8), out(8);
  const std::vector<std::size_t> counts{4, 4};
  comm.all_to_all_async(ddp::into(out), ddp::from(in), counts, counts).wait();
#elif CASE == 11
  std::vector<float> grads(4);
  comm.all_reduce(ddp::from(grads));
#elif CASE == 12  // a temporary in an _async call: gone before the collective reads it
  std::vector<float> all(8);
  comm.all_gather_async(ddp::from(std::vector<float>(4)), ddp::into(all)).wait();
#endif
#else
  // What each case should have written.
  std::vector<float> grads(4);
  comm.all_reduce(grads);
  std::vector<std::uint8_t> flags(4);
  comm.all_reduce(flags, ddp::ReduceOp::max);
  std::vector<std::complex<float> > field(4);
  comm.all_reduce(std::span<float>(reinterpret_cast<float*>(field.data()), 2 * field.size()));
  std::vector<std::int16_t> counts(4);  // 16-bit integers are carried
  std::vector<std::uint16_t> all(4 * static_cast<std::size_t>(comm.size()));
  comm.all_reduce(counts);
  comm.all_gather(std::span<std::uint16_t>(all).first(4), all);
  std::vector<std::vector<float> > layers(3, std::vector<float>(4));
  comm.all_reduce_coalesced(layers);
  std::vector<float> mine(4), gathered(4 * static_cast<std::size_t>(comm.size()));
  comm.all_gather(ddp::from(mine), ddp::into(gathered));
  const std::vector<std::size_t> fours(static_cast<std::size_t>(comm.size()), 4);
  std::vector<float> spread(gathered.size());
  comm.all_to_all_async(ddp::from(gathered), ddp::into(spread), fours, fours).wait();
  comm.all_reduce(ddp::into(grads));
#endif
}

int main() {}
