// The collective test cases, written once for any Communicator<Backend> and run by the
// backend::Host tests (test_communicator.cpp, forked ranks) and the backend::Mpi tests
// (tests/mpi, under mpirun), against references computed here.
#pragma once

#include "multiprocess.hpp"

#include <ddp/data/partition.hpp>
#include <ddp/training/averaging/gradient.hpp>
#include <ddp/training/guard.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <ranges>
#include <span>
#include <type_traits>

namespace cases {

using ddp::ReduceOp;

template <class F>
void for_each_dtype(F&& f) {
  f.template operator()<std::int8_t>();
  f.template operator()<std::uint8_t>();
  f.template operator()<std::int16_t>();
  f.template operator()<std::uint16_t>();
  f.template operator()<std::int32_t>();
  f.template operator()<std::uint32_t>();
  f.template operator()<std::int64_t>();
  f.template operator()<std::uint64_t>();
  f.template operator()<ddp::half>();
  f.template operator()<ddp::bfloat16>();
  f.template operator()<float>();
  f.template operator()<double>();
  f.template operator()<bool>();
}

/// A contiguous array of bool with the members of std::vector the cases use (std::vector<bool>
/// packs bits: it is no tensor).
class BoolArray {
 public:
  using value_type = bool;
  BoolArray() = default;
  explicit BoolArray(std::size_t n) : data_(new bool[n]()), size_(n), capacity_(n) {}
  template <class It>
  BoolArray(It first, It last) {
    for (; first != last; ++first) push_back(*first);
  }
  BoolArray(const BoolArray& o) : BoolArray(o.begin(), o.end()) {}
  BoolArray& operator=(const BoolArray& o) {
    if (this != &o) {
      clear();
      for (bool x : o) push_back(x);
    }
    return *this;
  }
  void push_back(bool x) {
    if (size_ == capacity_) {
      capacity_ = std::max<std::size_t>(8, capacity_ * 2);
      std::unique_ptr<bool[]> grown(new bool[capacity_]());
      std::copy(begin(), end(), grown.get());
      data_ = std::move(grown);
    }
    data_[size_++] = x;
  }
  void clear() noexcept { size_ = 0; }
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] bool* data() noexcept { return data_.get(); }
  [[nodiscard]] const bool* data() const noexcept { return data_.get(); }
  bool* begin() noexcept { return data_.get(); }
  bool* end() noexcept { return data_.get() + size_; }
  [[nodiscard]] const bool* begin() const noexcept { return data_.get(); }
  [[nodiscard]] const bool* end() const noexcept { return data_.get() + size_; }
  bool& operator[](std::size_t i) noexcept { return data_[i]; }
  const bool& operator[](std::size_t i) const noexcept { return data_[i]; }

 private:
  std::unique_ptr<bool[]> data_;
  std::size_t size_ = 0, capacity_ = 0;
};

/// The cases' buffer of T: std::vector<T>, BoolArray for bool.
template <class T>
using Vec = std::conditional_t<std::is_same_v<T, bool>, BoolArray, std::vector<T>>;

/// Every operator but premul_sum (premul_sum_every_form has it, with its factor).
constexpr ReduceOp all_ops[] = {ReduceOp::sum, ReduceOp::prod, ReduceOp::min, ReduceOp::max,
                                ReduceOp::avg, ReduceOp::band, ReduceOp::bor, ReduceOp::bxor};

/// How a case passes its buffers: as they are (compile-time typed), or through RuntimeTensor.
struct AsIs {
  template <class B>
  B&& operator()(B&& b) const {
    return std::forward<B>(b);
  }
};

/// A tensor whose element type is known only at run time, as a framework's is: a pointer, an
/// element count and a ddp::DType, adapted through ddp::tensor_traits (ddp::DynamicView).
struct RuntimeTensor {
  void* data = nullptr;
  std::size_t numel = 0;
  ddp::DType dtype = ddp::DType::float32;
  bool read_only = false;
};

}  // namespace cases

template <>
struct ddp::tensor_traits<cases::RuntimeTensor> {
  static ddp::DynamicView view(const cases::RuntimeTensor& t) {
    return {.data = t.data,
            .size = t.numel,
            .dtype = t.dtype,
            .device = ddp::Device::cpu(),
            .read_only = t.read_only};
  }
};

namespace cases {

/// The same, adapted through a member ddp_view() (the second customization point).
struct RuntimeTensorMember {
  RuntimeTensor t;
  [[nodiscard]] ddp::DynamicView ddp_view() const {
    return {t.data, t.numel, t.dtype, ddp::Device::cpu(), nullptr, true, t.read_only, nullptr};
  }
};

/// Wraps a contiguous range as a RuntimeTensor (Member: a RuntimeTensorMember).
template <bool Member>
struct AsRuntimeT {
  template <class B>
  auto operator()(B&& b) const {
    using E = std::remove_cvref_t<decltype(*std::ranges::data(b))>;
    const RuntimeTensor t{const_cast<E*>(std::ranges::data(b)), std::ranges::size(b),
                          ddp::dtype_of<E>, false};
    if constexpr (Member)
      return RuntimeTensorMember{t};
    else
      return t;
  }
};
using AsRuntime = AsRuntimeT<false>;
using AsRuntimeMember = AsRuntimeT<true>;

/// Rank r's i-th input: small integers for integer types; values whose sums round, for floats,
/// so that the order of summation shows in the bits.
template <class T>
T value(int rank, std::size_t i, int salt = 0) {
  const auto k = static_cast<std::size_t>(rank * 37 + salt * 13) + i * 11;
  if constexpr (std::is_same_v<T, bool>) {
    return k % 3 != 0;
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<int>(k % 5) + 1 -
                          (std::is_signed_v<T> && (k % 3 == 0) ? 3 : 0));
  } else {
    return T(static_cast<float>(k % 97) * 0.0625f + 0.01f * static_cast<float>(rank + 1) + 0.3f);
  }
}

/// One step of a floating-point reduction (avg sums; the caller divides at the end).
template <class A>
A combine_float(ReduceOp op, A acc, A x) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return acc + x;
    case ReduceOp::prod: return acc * x;
    case ReduceOp::min: return x < acc ? x : acc;
    case ReduceOp::max: return acc < x ? x : acc;
    default: break;  // bitwise: integers only; premul_sum: the caller scales and sums
  }
  return acc;
}

/// One step of a bool reduction: or for sum, max and bor, and for prod, min and band, xor.
inline bool combine_bool(ReduceOp op, bool acc, bool x) {
  switch (op) {
    case ReduceOp::prod:
    case ReduceOp::min:
    case ReduceOp::band: return acc && x;
    case ReduceOp::bxor: return acc != x;
    default: return acc || x;
  }
}

/// The documented semantics: combine in rank order 0..P-1; half and bfloat16 in float, rounded
/// once; integers wrap; avg divides by P. all_reduce across `hosts` > 1 hosts (of consecutive
/// ranks, as mp::Path makes them): floating-point values combine as each host's result, rounded
/// to T, in host order, avg dividing that by P (integers wrap the same in any order). v(r): rank
/// r's value. Written independently of the library's kernels.
template <class T, class V>
T reference_of(ReduceOp op, int p, V&& v, int hosts = 1) {
  using A = std::conditional_t<std::is_same_v<T, ddp::half> || std::is_same_v<T, ddp::bfloat16>,
                               float, T>;
  if constexpr (!std::is_integral_v<T>) {
    if (hosts > 1 && p > 1) {
      std::vector<T> sums;
      for (int h = 0; h < hosts; ++h) {
        std::vector<T> mine;
        for (int r = 0; r < p; ++r) {
          if (r * hosts / p == h) mine.push_back(v(r));
        }
        if (mine.empty()) continue;
        auto acc = static_cast<A>(mine[0]);
        for (std::size_t k = 1; k < mine.size(); ++k)
          acc = combine_float(op, acc, static_cast<A>(mine[k]));
        sums.push_back(static_cast<T>(acc));
      }
      auto acc = static_cast<A>(sums[0]);
      for (std::size_t k = 1; k < sums.size(); ++k)
        acc = combine_float(op, acc, static_cast<A>(sums[k]));
      auto out = static_cast<T>(acc);
      if (op == ReduceOp::avg) out = static_cast<T>(static_cast<A>(out) / static_cast<A>(p));
      return out;
    }
  }
  auto acc = static_cast<A>(v(0));
  for (int r = 1; r < p; ++r) {
    const auto x = static_cast<A>(v(r));
    if constexpr (std::is_same_v<A, bool>) {
      acc = combine_bool(op, acc, x);
    } else if constexpr (std::is_integral_v<A>) {
      using U = std::make_unsigned_t<A>;
      switch (op) {
        case ReduceOp::sum:
          acc = static_cast<A>(static_cast<U>(static_cast<U>(acc) + static_cast<U>(x)));
          break;
        case ReduceOp::prod:
          acc = static_cast<A>(static_cast<U>(static_cast<std::uint64_t>(static_cast<U>(acc)) *
                                              static_cast<std::uint64_t>(static_cast<U>(x))));
          break;
        case ReduceOp::min: acc = std::min(acc, x); break;
        case ReduceOp::max: acc = std::max(acc, x); break;
        case ReduceOp::band: acc = static_cast<A>(acc & x); break;
        case ReduceOp::bor: acc = static_cast<A>(acc | x); break;
        case ReduceOp::bxor: acc = static_cast<A>(acc ^ x); break;
        default: break;
      }
    } else {
      acc = combine_float(op, acc, x);
    }
  }
  if constexpr (!std::is_integral_v<A>) {
    if (op == ReduceOp::avg) acc = acc / static_cast<A>(p);
  }
  return static_cast<T>(acc);
}

template <class T>
T reference(ReduceOp op, int p, std::size_t i, int salt = 0) {
  return reference_of<T>(op, p, [&](int r) { return value<T>(r, i, salt); });
}

/// reference() in the order of all_reduce on this child's path (mp::Path::enter).
template <class T>
T all_reduce_reference(ReduceOp op, int p, std::size_t i, int salt = 0) {
  return reference_of<T>(
      op, p, [&](int r) { return value<T>(r, i, salt); }, mp::current_hosts);
}

template <class T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

template <class T>
std::string show(const T& v) {
  if constexpr (std::is_integral_v<T>)
    return std::to_string(static_cast<long long>(v));
  else
    return std::to_string(static_cast<double>(static_cast<float>(v)));
}

/// Counts to test for element type T: empty, one, odd, and more than three segments.
template <class T>
std::vector<std::size_t> counts() {
  return {0, 1, 7, 3 * mp::test_segment / sizeof(T) + 5};
}

/// Whether floating-point results must equal the rank-order reference bit for bit (backend::Host
/// promises it) or only within a few units in the last place (backend::Mpi, whose library
/// chooses the order of combination).
inline bool bitwise_floats = true;

template <class T>
bool close_enough(const T& got, const T& want) {
  if (same_bits(got, want)) return true;
  if constexpr (std::is_integral_v<T>) {
    return false;
  } else {
    const double g = static_cast<float>(got), w = static_cast<float>(want);
    const double eps = std::is_same_v<T, double>  ? 1e-12
                       : std::is_same_v<T, float> ? 1e-5
                                                  : 2e-2;  // half, bfloat16
    return !bitwise_floats && std::abs(g - w) <= eps * std::max(1.0, std::abs(w));
  }
}

template <class T>
void check_values(const Vec<T>& got, const std::function<T(std::size_t)>& want,
                  const std::string& what) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    const T w = want(i);
    MP_EXPECT(close_enough(got[i], w),
              what << ": element " << i << " is " << show(got[i]) << ", expected " << show(w));
  }
}

template <class C, class Wrap = AsIs>
void all_reduce_every_dtype(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  for_each_dtype([&]<class T>() {
    for (ReduceOp op : all_ops) {
      if (!ddp::is_supported(op, ddp::dtype_of<T>)) continue;
      for (std::size_t n : counts<T>()) {
        Vec<T> buf(n);
        for (std::size_t i = 0; i < n; ++i) buf[i] = value<T>(r, i);
        const std::string what = "all_reduce(" + std::string(ddp::to_string(ddp::dtype_of<T>)) +
                                 ", " + std::string(ddp::to_string(op)) +
                                 ", n=" + std::to_string(n) + ")";
        if (n % 2 == 0)
          comm.all_reduce(wrap(buf), op);
        else
          comm.all_reduce_async(wrap(buf), op).wait();
        check_values<T>(
            buf, [&](std::size_t i) { return all_reduce_reference<T>(op, p, i); }, what);
      }
    }
  });
}

template <class C, class Wrap = AsIs>
void reduce_to_root(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  for_each_dtype([&]<class T>() {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
      for (int root : {0, p - 1}) {
        for (std::size_t n : counts<T>()) {
          Vec<T> buf(n);
          for (std::size_t i = 0; i < n; ++i) buf[i] = value<T>(r, i, 1);
          comm.reduce(wrap(buf), root, op);
          const std::string what =
              "reduce(root " + std::to_string(root) + ", n=" + std::to_string(n) + ")";
          if (r == root)
            check_values<T>(
                buf, [&](std::size_t i) { return reference<T>(op, p, i, 1); }, what);
          else
            check_values<T>(
                buf, [&](std::size_t i) { return value<T>(r, i, 1); }, what + " non-root");
        }
      }
    }
  });
}

template <class C, class Wrap = AsIs>
void broadcast_every_root(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  for_each_dtype([&]<class T>() {
    for (int root = 0; root < p; ++root) {
      for (std::size_t n : counts<T>()) {
        Vec<T> buf(n);
        for (std::size_t i = 0; i < n; ++i) buf[i] = value<T>(r, i);
        if (root % 2 == 0)
          comm.broadcast(wrap(buf), root);
        else
          comm.broadcast_async(wrap(buf), root).wait();
        check_values<T>(
            buf, [&](std::size_t i) { return value<T>(root, i); },
            "broadcast(root " + std::to_string(root) + ")");
      }
    }
  });
}

template <class C, class Wrap = AsIs>
void all_gather_and_gather(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  const auto up = static_cast<std::size_t>(p);
  for_each_dtype([&]<class T>() {
    for (std::size_t n : counts<T>()) {
      Vec<T> in(n);
      for (std::size_t i = 0; i < n; ++i) in[i] = value<T>(r, i);
      const auto want = [&](std::size_t k) {
        return value<T>(static_cast<int>(k / std::max<std::size_t>(n, 1)),
                        k % std::max<std::size_t>(n, 1));
      };
      Vec<T> out(n * up);
      comm.all_gather(wrap(in), wrap(out));
      check_values<T>(out, want, "all_gather(n=" + std::to_string(n) + ")");
      // In place: this rank's block of `out` is the input.
      Vec<T> inplace(n * up);
      std::copy(in.begin(), in.end(),
                inplace.begin() + static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(r)));
      comm.all_gather(wrap(std::span<T>(inplace).subspan(n * static_cast<std::size_t>(r), n)),
                      wrap(inplace));
      check_values<T>(inplace, want, "all_gather in place");
      for (int root : {0, p - 1}) {
        Vec<T> g(r == root ? n * up : 0);
        comm.gather(wrap(in), wrap(g), root);
        if (r == root) check_values<T>(g, want, "gather(root " + std::to_string(root) + ")");
      }
    }
  });
}

template <class C, class Wrap = AsIs>
void scatter_reduce_scatter_all_to_all(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  const auto up = static_cast<std::size_t>(p);
  for_each_dtype([&]<class T>() {
    for (std::size_t n :
         {std::size_t{0}, std::size_t{1}, std::size_t{5}, mp::test_segment / sizeof(T) + 3}) {
      const std::string tag = "(n=" + std::to_string(n) + ")";
      // scatter: block j of root's input goes to rank j.
      for (int root : {0, p - 1}) {
        Vec<T> in(r == root ? n * up : 0);
        for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<T>(root, k, 2);
        Vec<T> out(n);
        comm.scatter(wrap(in), wrap(out), root);
        check_values<T>(
            out,
            [&](std::size_t i) { return value<T>(root, static_cast<std::size_t>(r) * n + i, 2); },
            "scatter" + tag);
      }
      // reduce_scatter: block r of the element-wise reduction, in all_reduce's order.
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::min}) {
        Vec<T> in(n * up);
        for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<T>(r, k, 3);
        Vec<T> out(n);
        comm.reduce_scatter(wrap(in), wrap(out), op);
        check_values<T>(
            out,
            [&](std::size_t i) {
              return all_reduce_reference<T>(op, p, static_cast<std::size_t>(r) * n + i, 3);
            },
            "reduce_scatter" + tag);
        // In place: out is this rank's block of in.
        for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<T>(r, k, 3);
        auto mine = std::span<T>(in).subspan(static_cast<std::size_t>(r) * n, n);
        comm.reduce_scatter(wrap(in), wrap(mine), op);
        Vec<T> copy(mine.begin(), mine.end());
        check_values<T>(
            copy,
            [&](std::size_t i) {
              return all_reduce_reference<T>(op, p, static_cast<std::size_t>(r) * n + i, 3);
            },
            "reduce_scatter in place" + tag);
      }
      // all_to_all: out block j = rank j's in block r.
      Vec<T> in(n * up), out(n * up);
      for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<T>(r, k, 4);
      comm.all_to_all(wrap(in), wrap(out));
      check_values<T>(
          out,
          [&](std::size_t k) {
            const auto j = static_cast<int>(k / std::max<std::size_t>(n, 1));
            return value<T>(j, static_cast<std::size_t>(r) * n + k % std::max<std::size_t>(n, 1),
                            4);
          },
          "all_to_all" + tag);
    }
  });
}

/// The collectives with a count per rank (all_to_all with split sizes, all_gather, gather and
/// scatter with counts), sync and async: counts of 0, 1 and 2 elements and one block larger
/// than a round (test_segment), every dtype, both roots.
template <class C, class Wrap = AsIs>
void uneven_collectives(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  const auto up = static_cast<std::size_t>(p);
  const auto sum = [](const std::vector<std::size_t>& v) {
    std::size_t s = 0;
    for (std::size_t x : v) s += x;
    return s;
  };
  for_each_dtype([&]<class T>() {
    const std::size_t big = mp::test_segment / sizeof(T) + 3, stride = big + 10;
    // Elements rank i sends to rank j.
    const auto f = [&](int i, int j) -> std::size_t {
      return i == 0 && j == p - 1 ? big : static_cast<std::size_t>((i + 2 * j) % 3);
    };
    for (const bool async : {false, true}) {
      const std::string how = async ? " (async)" : "";
      // all_to_all: block j of `in` to rank j.
      std::vector<std::size_t> inc(up), outc(up);
      for (int j = 0; j < p; ++j) {
        inc[static_cast<std::size_t>(j)] = f(r, j);
        outc[static_cast<std::size_t>(j)] = f(j, r);
      }
      Vec<T> in, out(sum(outc));
      for (int j = 0; j < p; ++j) {
        for (std::size_t k = 0; k < f(r, j); ++k)
          in.push_back(value<T>(r, static_cast<std::size_t>(j) * stride + k, 5));
      }
      if (async)
        comm.all_to_all_async(wrap(in), wrap(out), inc, outc).wait();
      else
        comm.all_to_all(wrap(in), wrap(out), inc, outc);
      Vec<T> want;
      for (int j = 0; j < p; ++j) {
        for (std::size_t k = 0; k < f(j, r); ++k)
          want.push_back(value<T>(j, static_cast<std::size_t>(r) * stride + k, 5));
      }
      check_values<T>(
          out, [&](std::size_t i) { return want[i]; }, "all_to_all uneven" + how);
      // all_gather and gather: rank j offers f(j, p - 1) elements.
      std::vector<std::size_t> counts(up);
      for (int j = 0; j < p; ++j) counts[static_cast<std::size_t>(j)] = f(j, p - 1);
      Vec<T> mine(counts[static_cast<std::size_t>(r)]);
      for (std::size_t k = 0; k < mine.size(); ++k) mine[k] = value<T>(r, k, 6);
      Vec<T> every;
      for (int j = 0; j < p; ++j) {
        for (std::size_t k = 0; k < counts[static_cast<std::size_t>(j)]; ++k)
          every.push_back(value<T>(j, k, 6));
      }
      Vec<T> all(every.size());
      if (async)
        comm.all_gather_async(wrap(mine), wrap(all), counts).wait();
      else
        comm.all_gather(wrap(mine), wrap(all), counts);
      check_values<T>(
          all, [&](std::size_t i) { return every[i]; }, "all_gather uneven" + how);
      for (int root : {0, p - 1}) {
        const std::string at = " (root " + std::to_string(root) + ")" + how;
        Vec<T> g(r == root ? every.size() : 0);
        const std::vector<std::size_t> none;  // counts are read on the root only
        const std::vector<std::size_t>& cs = r == root ? counts : none;
        if (async)
          comm.gather_async(wrap(mine), wrap(g), cs, root).wait();
        else
          comm.gather(wrap(mine), wrap(g), cs, root);
        if (r == root)
          check_values<T>(
              g, [&](std::size_t i) { return every[i]; }, "gather" + at);
        // scatter: block j of root's `in` (f(root, j) elements) to rank j.
        std::vector<std::size_t> sc(up);
        Vec<T> src;
        for (int j = 0; j < p; ++j) {
          sc[static_cast<std::size_t>(j)] = f(root, j);
          for (std::size_t k = 0; k < f(root, j); ++k)
            src.push_back(value<T>(root, static_cast<std::size_t>(j) * stride + k, 7));
        }
        Vec<T> part(f(root, r));
        if (r != root) src.clear();
        if (async)
          comm.scatter_async(wrap(src), wrap(part), r == root ? sc : none, root).wait();
        else
          comm.scatter(wrap(src), wrap(part), r == root ? sc : none, root);
        check_values<T>(
            part,
            [&](std::size_t i) {
              return value<T>(root, static_cast<std::size_t>(r) * stride + i, 7);
            },
            "scatter uneven" + at);
      }
    }
  });
  // Counts of other integer types, as torch's split sizes are (copied): rank i sends i + j + 1
  // floats to rank j.
  {
    std::vector<int> ins(up);
    std::vector<std::int64_t> outs(up);
    for (int j = 0; j < p; ++j) {
      ins[static_cast<std::size_t>(j)] = r + j + 1;
      outs[static_cast<std::size_t>(j)] = j + r + 1;
    }
    std::vector<float> in, out(static_cast<std::size_t>(p * (p + 1) / 2 + p * r)), out2(out.size());
    for (int j = 0; j < p; ++j)
      for (int k = 0; k < r + j + 1; ++k) in.push_back(static_cast<float>(100 * r + j));
    comm.all_to_all(wrap(in), wrap(out), ins, outs);
    comm.all_to_all_async(wrap(in), wrap(out2), std::vector<int>(ins),
                          std::vector<std::int64_t>(outs))
        .wait();
    std::size_t at = 0;
    for (int j = 0; j < p; ++j) {
      for (int k = 0; k < j + r + 1; ++k, ++at) {
        MP_EXPECT(
            out[at] == static_cast<float>(100 * j + r) && out2[at] == out[at],
            "all_to_all with int counts: element " << at << " is " << out[at] << " / " << out2[at]);
      }
    }
  }
}

/// all_reduce_coalesced: several buffers of one type as one operation, sync and async.
template <class C, class Wrap = AsIs>
void all_reduce_coalesced(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  const std::vector<std::size_t> sizes = {0, 1, 7, 3 * mp::test_segment / sizeof(float) + 5};
  for (const bool async : {false, true}) {
    std::vector<std::vector<float>> bufs;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      bufs.emplace_back(sizes[k]);
      for (std::size_t i = 0; i < sizes[k]; ++i)
        bufs[k][i] = value<float>(r, i, static_cast<int>(k));
    }
    const auto run = [&](auto& range) {
      if (async)
        comm.all_reduce_coalesced_async(range, ReduceOp::avg).wait();
      else
        comm.all_reduce_coalesced(range, ReduceOp::avg);
    };
    if constexpr (std::is_same_v<Wrap, AsIs>) {
      run(bufs);
    } else {
      std::vector<decltype(wrap(bufs[0]))> wrapped;
      for (auto& b : bufs) wrapped.push_back(wrap(b));
      run(wrapped);
    }
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      check_values<float>(
          bufs[k],
          [&](std::size_t i) {
            return all_reduce_reference<float>(ReduceOp::avg, p, i, static_cast<int>(k));
          },
          "all_reduce_coalesced buffer " + std::to_string(k));
    }
  }
}

/// all_reduce_as<W>: every rank's float32 values rounded to W, combined in float in rank order,
/// the result rounded to W once and handed back as float32 -- the same bits as all_reduce on W.
template <class C>
void all_reduce_compressed(C& comm) {
  const int p = comm.size(), r = comm.rank();
  const auto input = [](int rank, std::size_t i) {  // not representable in W: rounding shows
    return value<float>(rank, i) + 0.0009f * static_cast<float>(i % 7 + 1);
  };
  const auto each_wire = [](auto&& f) {
    f.template operator()<ddp::half>();
    f.template operator()<ddp::bfloat16>();
  };
  each_wire([&]<class W>() {
    for (ReduceOp op : all_ops) {
      if (!ddp::is_supported(op, ddp::dtype_of<W>)) continue;
      for (std::size_t n :
           {std::size_t{0}, std::size_t{1}, std::size_t{7}, 3 * mp::test_segment / sizeof(W) + 5}) {
        const std::string what = "all_reduce_as<" + std::string(ddp::to_string(ddp::dtype_of<W>)) +
                                 ">(" + std::string(ddp::to_string(op)) +
                                 ", n=" + std::to_string(n) + ")";
        std::vector<float> buf(n);
        std::vector<W> wire(n);  // the same values, converted by hand and reduced as W
        for (std::size_t i = 0; i < n; ++i) {
          buf[i] = input(r, i);
          wire[i] = W(buf[i]);
        }
        if (n % 2 == 0)
          comm.template all_reduce_as<W>(buf, op);
        else
          comm.template all_reduce_as_async<W>(buf, op).wait();
        comm.all_reduce(wire, op);
        const double ulp =
            std::is_same_v<W, ddp::half> ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7);
        for (std::size_t i = 0; i < n; ++i) {
          const float want = static_cast<float>(reference_of<W>(
              op, p, [&](int k) { return W(input(k, i)); }, mp::current_hosts));
          const bool ok =
              bitwise_floats
                  ? same_bits(buf[i], want) && same_bits(buf[i], static_cast<float>(wire[i]))
                  : std::abs(buf[i] - want) <= 4 * ulp * std::abs(want);  // MPI: W at each step
          MP_EXPECT(ok, what << ": element " << i << " is " << buf[i] << ", expected " << want
                             << " (all_reduce on W gave " << static_cast<float>(wire[i]) << ")");
          if (!ok) return;
        }
      }
    }
  });
}

/// premul_sum (each rank's input multiplied by its own factor, in the element type's
/// precision, then summed in rank order) in every collective that reduces: all_reduce sync and
/// async, reduce (a non-root buffer unchanged), reduce_scatter (`in` unchanged),
/// all_reduce_coalesced and all_reduce_as; and the operators refused on floating point.
template <class C, class Wrap = AsIs>
void premul_sum_every_form(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  const auto factor = [](int rank) { return 0.25 + 0.5 * rank; };
  const auto each_float = [](auto&& f) {
    f.template operator()<ddp::half>();
    f.template operator()<ddp::bfloat16>();
    f.template operator()<float>();
    f.template operator()<double>();
  };
  each_float([&]<class T>() {
    using A = std::conditional_t<sizeof(T) == 2, float, T>;
    const auto scaled = [&](int rank, std::size_t i, int salt) {
      return static_cast<T>(static_cast<A>(value<T>(rank, i, salt)) * static_cast<A>(factor(rank)));
    };
    const auto want = [&](std::size_t i, int salt, int hosts) {
      return reference_of<T>(
          ReduceOp::sum, p, [&](int k) { return scaled(k, i, salt); }, hosts);
    };
    const std::string type(ddp::to_string(ddp::dtype_of<T>));
    for (std::size_t n : counts<T>()) {
      const std::string tag = "(" + type + ", premul_sum, n=" + std::to_string(n) + ")";
      Vec<T> buf(n);
      for (std::size_t i = 0; i < n; ++i) buf[i] = value<T>(r, i);
      if (n % 2 == 0)
        comm.all_reduce(wrap(buf), ddp::premul_sum(factor(r)));
      else
        comm.all_reduce_async(wrap(buf), ddp::premul_sum(factor(r))).wait();
      check_values<T>(
          buf, [&](std::size_t i) { return want(i, 0, mp::current_hosts); }, "all_reduce" + tag);
      for (int root : {0, p - 1}) {
        for (std::size_t i = 0; i < n; ++i) buf[i] = value<T>(r, i, 1);
        comm.reduce(wrap(buf), root, ddp::premul_sum(factor(r)));
        if (r == root)
          check_values<T>(
              buf, [&](std::size_t i) { return want(i, 1, 1); }, "reduce" + tag);
        else
          check_values<T>(
              buf, [&](std::size_t i) { return value<T>(r, i, 1); }, "reduce non-root" + tag);
      }
      Vec<T> in(n * static_cast<std::size_t>(p)), out(n);
      for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<T>(r, k, 3);
      const Vec<T> before = in;
      comm.reduce_scatter(wrap(in), wrap(out), ddp::premul_sum(factor(r)));
      check_values<T>(
          out,
          [&](std::size_t i) {
            return want(static_cast<std::size_t>(r) * n + i, 3, mp::current_hosts);
          },
          "reduce_scatter" + tag);
      check_values<T>(
          in, [&](std::size_t k) { return before[k]; }, "reduce_scatter's in" + tag);
    }
    // Refused by name on floating point, before anything is sent: the communicator stays usable.
    for (ReduceOp op : {ReduceOp::band, ReduceOp::bor, ReduceOp::bxor}) {
      Vec<T> x(3);
      try {
        comm.all_reduce(wrap(x), op);
        MP_EXPECT(false, "all_reduce(" << type << ", " << ddp::to_string(op) << ") was accepted");
      } catch (const ddp::Error& e) {
        const std::string m = e.what();
        MP_EXPECT(e.code() == ddp::Errc::invalid_argument &&
                      m.find("op " + std::string(ddp::to_string(op)) + " is not defined on " +
                             type) != std::string::npos,
                  m);
      }
    }
  });
  // premul_sum without its factor (a bare ReduceOp::premul_sum), or with one the multiplication's
  // type cannot hold: refused before anything is sent, on every rank alike.
  std::vector<float> f32(3, 1.0f);
  for (const ddp::Reduction bad :
       {ddp::Reduction(ReduceOp::premul_sum), ddp::premul_sum(std::nan("")), ddp::premul_sum(1e300),
        ddp::premul_sum(-std::numeric_limits<double>::infinity())}) {
    try {
      comm.all_reduce(wrap(f32), bad);
      MP_EXPECT(false, "premul_sum(" << bad.factor << ") was accepted");
    } catch (const ddp::Error& e) {
      const std::string m = e.what();
      MP_EXPECT(
          e.code() == ddp::Errc::invalid_argument && m.find("premul_sum") != std::string::npos, m);
    }
  }
  std::vector<double> f64(3, 1.0);
  comm.all_reduce(wrap(f64), ddp::premul_sum(1e300));  // within double's range
  MP_EXPECT(f64[0] == 1e300 * p, "premul_sum(1e300) on double: " << f64[0]);
  std::vector<float> a(5), b(3);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = value<float>(r, i);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = value<float>(r, i, 1);
  std::vector<std::vector<float>> many{a, b};
  comm.all_reduce_coalesced(many, ddp::premul_sum(factor(r)));
  for (int k = 0; k < 2; ++k) {
    check_values<float>(
        many[static_cast<std::size_t>(k)],
        [&](std::size_t i) {
          return reference_of<float>(
              ReduceOp::sum, p,
              [&](int j) { return value<float>(j, i, k) * static_cast<float>(factor(j)); },
              mp::current_hosts);
        },
        "all_reduce_coalesced(premul_sum) buffer " + std::to_string(k));
  }
  std::vector<float> c(7);
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = value<float>(r, i);
  comm.template all_reduce_as<ddp::bfloat16>(c, ddp::premul_sum(factor(r)));
  Vec<ddp::bfloat16> c16(c.size());  // exact: the result is a bfloat16 decoded
  for (std::size_t i = 0; i < c.size(); ++i) c16[i] = ddp::bfloat16(c[i]);
  check_values<ddp::bfloat16>(
      c16,
      [&](std::size_t i) {
        return reference_of<ddp::bfloat16>(
            ReduceOp::sum, p,
            [&](int j) {
              return ddp::bfloat16(value<float>(j, i) * static_cast<float>(factor(j)));
            },
            mp::current_hosts);
      },
      "all_reduce_as<bfloat16>(premul_sum)");
}

/// The buffer-pair collectives with their roles named (ddp::from, ddp::into), sync and async,
/// even and uneven, and the single-buffer ones with ddp::into: the same results as the
/// positional form.
template <class C, class Wrap = AsIs>
void named_roles(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  const auto up = static_cast<std::size_t>(p);
  const std::size_t n = 5;
  std::vector<float> mine(n), all(n * up), again(n * up);
  for (std::size_t i = 0; i < n; ++i) mine[i] = value<float>(r, i);
  comm.all_gather(ddp::from(wrap(mine)), ddp::into(wrap(all)));
  comm.all_gather_async(ddp::from(wrap(mine)), ddp::into(wrap(again))).wait();
  const auto gathered = [&](std::size_t k) { return value<float>(static_cast<int>(k / n), k % n); };
  check_values<float>(all, gathered, "all_gather(from, into)");
  check_values<float>(again, gathered, "all_gather_async(from, into)");
  std::vector<float> g(r == 0 ? n * up : 0);
  comm.gather(ddp::from(wrap(mine)), ddp::into(wrap(g)), 0);
  if (r == 0) check_values<float>(g, gathered, "gather(from, into)");
  std::vector<float> part(n);
  comm.scatter(ddp::from(wrap(all)), ddp::into(wrap(part)), p - 1);
  check_values<float>(
      part, [&](std::size_t i) { return gathered(static_cast<std::size_t>(r) * n + i); },
      "scatter(from, into)");
  std::vector<float> in(n * up), out(n);
  for (std::size_t k = 0; k < in.size(); ++k) in[k] = value<float>(r, k, 3);
  comm.reduce_scatter(ddp::from(wrap(in)), ddp::into(wrap(out)), ReduceOp::max);
  check_values<float>(
      out,
      [&](std::size_t i) {
        return reference<float>(ReduceOp::max, p, static_cast<std::size_t>(r) * n + i, 3);
      },
      "reduce_scatter(from, into)");
  std::vector<float> spread(n * up);
  comm.all_to_all(ddp::from(wrap(in)), ddp::into(wrap(spread)));
  const auto swapped = [&](std::size_t k) {
    return value<float>(static_cast<int>(k / n), static_cast<std::size_t>(r) * n + k % n, 3);
  };
  check_values<float>(spread, swapped, "all_to_all(from, into)");
  const std::vector<std::size_t> counts(up, n);
  std::fill(spread.begin(), spread.end(), 0.0f);
  comm.all_to_all_async(ddp::from(wrap(in)), ddp::into(wrap(spread)), counts, counts).wait();
  check_values<float>(spread, swapped, "all_to_all_async(from, into, counts, counts)");
  std::vector<float> sum(mine);
  comm.all_reduce(ddp::into(wrap(sum)));
  check_values<float>(
      sum, [&](std::size_t i) { return all_reduce_reference<float>(ReduceOp::sum, p, i); },
      "all_reduce(into)");
}

/// all_reduce_host/broadcast_host and the layers built on them (exact_mean, ZeroFirstGuard):
/// small host values on any backend.
template <class C>
void host_values(C& comm) {
  const int p = comm.size(), r = comm.rank();
  std::vector<std::int64_t> v{r, 1, -r};
  comm.all_reduce_host(std::span<std::int64_t>(v), ReduceOp::sum);
  MP_EXPECT(v[0] == p * (p - 1) / 2 && v[1] == p && v[2] == -v[0], "all_reduce_host sum");
  std::vector<double> m{static_cast<double>(r)};
  comm.all_reduce_host(std::span<double>(m), ReduceOp::max);
  MP_EXPECT(m[0] == p - 1, "all_reduce_host max " << m[0]);
  std::vector<float> b{static_cast<float>(r) + 0.5f, 2.0f};
  comm.broadcast_host(std::span<float>(b), p - 1);
  MP_EXPECT(b[0] == static_cast<float>(p - 1) + 0.5f && b[1] == 2.0f, "broadcast_host");
  // Rank r contributes r samples of value r: the mean is sum(r^2) / sum(r).
  double sq = 0, n = 0;
  for (int k = 0; k < p; ++k) sq += k * k, n += k;
  const double mean =
      ddp::exact_mean(comm, static_cast<double>(r * r), static_cast<std::size_t>(r));
  MP_EXPECT(mean == (n > 0 ? sq / n : 0.0), "exact_mean " << mean);
  { ddp::ZeroFirstGuard guard(comm); }
}

template <class C, class Wrap = AsIs>
void send_recv_ring(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{300000}}) {  // > a channel
    std::vector<double> out(n), in(n);
    for (std::size_t i = 0; i < n; ++i) out[i] = r * 1e6 + static_cast<double>(i);
    const int next = (r + 1) % p, prev = (r + p - 1) % p;
    // Even ranks send first, odd ranks receive first: no cycle of blocked senders.
    if (r % 2 == 0) {
      comm.send(wrap(out), next, 7);
      comm.recv(wrap(in), prev, 7);
    } else {
      comm.recv(wrap(in), prev, 7);
      comm.send(wrap(out), next, 7);
    }
    for (std::size_t i = 0; i < n; ++i)
      MP_EXPECT(in[i] == prev * 1e6 + static_cast<double>(i), "ring element " << i);
    comm.barrier();
  }
  auto w = comm.barrier_async();
  w.wait();
  MP_EXPECT(w.test() && !w.failed(), "barrier_async");
}

/// batch_isend_irecv: every rank sends to and receives from every other rank at once, sends
/// listed first (a naive order deadlocks once a message exceeds a channel), two messages per
/// pair and direction (they match in order), sizes up to beyond a channel; then a batch on one
/// side matched by plain send/recv on the other.
template <class C, class Wrap = AsIs>
void batch_p2p(C& comm, Wrap wrap = {}) {
  const int p = comm.size(), r = comm.rank();
  const auto n_of = [](int from, int to, int k) {
    return static_cast<std::size_t>(from == 0 && k == 1 ? 300000 : 10 * (from + 1) + to + k);
  };
  std::vector<std::vector<double>> out, in;
  std::vector<ddp::P2POp> ops;
  out.reserve(2 * static_cast<std::size_t>(p));
  in.reserve(2 * static_cast<std::size_t>(p));
  for (int j = 0; j < p; ++j) {
    for (int k = 0; k < 2 && j != r; ++k) {
      out.emplace_back(n_of(r, j, k));
      for (std::size_t i = 0; i < out.back().size(); ++i)
        out.back()[i] = r * 1e7 + j * 1e5 + k * 1e4 + static_cast<double>(i % 1000);
      ops.push_back(ddp::P2POp::send(wrap(out.back()), j, k));
    }
  }
  for (int j = 0; j < p; ++j) {
    for (int k = 0; k < 2 && j != r; ++k) {
      in.emplace_back(n_of(j, r, k));
      ops.push_back(ddp::P2POp::recv(wrap(in.back()), j, k));
    }
  }
  comm.batch_isend_irecv(ops).wait();
  std::size_t at = 0;
  for (int j = 0; j < p; ++j) {
    for (int k = 0; k < 2 && j != r; ++k, ++at) {
      for (std::size_t i = 0; i < in[at].size(); ++i)
        MP_EXPECT(in[at][i] == j * 1e7 + r * 1e5 + k * 1e4 + static_cast<double>(i % 1000),
                  "batch from rank " << j << " message " << k << " element " << i);
    }
  }
  if (p > 1) {  // rank 0's batch against plain send/recv on rank 1
    std::vector<float> a(1000, static_cast<float>(r)), b(1000);
    if (r == 0) {
      const ddp::P2POp pair[] = {ddp::P2POp::recv(wrap(b), 1, 3), ddp::P2POp::send(wrap(a), 1, 3)};
      comm.batch_isend_irecv(pair).wait();
    } else if (r == 1) {
      comm.recv(wrap(b), 0, 3);
      comm.send(wrap(a), 0, 3);
    }
    if (r <= 1) MP_EXPECT(b[999] == static_cast<float>(1 - r), "batch against plain");
  }
  comm.barrier();
}

template <class C, class Wrap = AsIs>
void async_in_issue_order(C& comm, Wrap wrap = {}) {
  const int p = comm.size();
  std::vector<std::vector<float>> bufs(6, std::vector<float>(20000));
  std::vector<ddp::Work> works;
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    std::fill(bufs[k].begin(), bufs[k].end(),
              static_cast<float>(comm.rank() + static_cast<int>(k)));
    works.push_back(comm.all_reduce_async(wrap(bufs[k])));
  }
  std::vector<int> sync{comm.rank()};
  comm.all_reduce(wrap(sync));  // waits for the queued ones, then runs
  for (auto& w : works) w.wait();
  for (std::size_t k = 0; k < bufs.size(); ++k) {
    const float want = static_cast<float>(p * (p - 1) / 2 + p * static_cast<int>(k));
    MP_EXPECT(bufs[k][0] == want && bufs[k].back() == want,
              "async all_reduce " << k << " gave " << bufs[k][0]);
  }
  MP_EXPECT(sync[0] == p * (p - 1) / 2, "sync all_reduce after async ones");
}

template <class C>
void split_by_color(C& comm) {
  const int r = comm.rank(), p = comm.size();
  // Two groups by parity, ordered by descending world rank.
  auto sub = comm.split(r % 2, -r);
  const int members = (p + 1 - r % 2) / 2;
  MP_EXPECT(sub.valid() && sub.size() == members, "split size " << sub.size());
  std::vector<int> v{r};
  sub.all_reduce(v);
  int want = 0;
  for (int k = r % 2; k < p; k += 2) want += k;
  MP_EXPECT(v[0] == want, "sum within the group: " << v[0] << " != " << want);
  auto ranks = sub.all_gather_object(r);
  for (std::size_t i = 1; i < ranks.size(); ++i) MP_EXPECT(ranks[i - 1] > ranks[i], "key order");
  MP_EXPECT(ranks[static_cast<std::size_t>(sub.rank())] == r, "own slot");
  // A rank can stay out, and the others still form a group.
  auto partial = comm.split(r == 0 ? C::no_color : 1);
  MP_EXPECT(partial.valid() == (r != 0), "no_color");
  if (partial.valid()) {
    MP_EXPECT(partial.size() == p - 1, "partial size");
    partial.barrier();
  }
  // The ranks on this host: all of them on one host, the host's share across hosts.
  auto& local = comm.local_group();
  MP_EXPECT(local.size() == comm.local_size(), "local group size");
  MP_EXPECT(local.rank() == comm.local_rank(), "local group rank");
  local.barrier();
  // A group with its own options: its timeout, not the parent's.
  ddp::Options own = comm.options();
  own.timeout = std::chrono::milliseconds(4321);
  auto timed = comm.split(0, r, own);
  MP_EXPECT(timed.options().timeout == own.timeout, "split's own timeout");
  MP_EXPECT(comm.options().timeout != own.timeout, "the parent keeps its timeout");
  std::vector<int> one{1};
  timed.all_reduce(one);
  MP_EXPECT(one[0] == p, "split with options works");
  // monitored_barrier: every rank arrives, on the parent and on the group.
  comm.monitored_barrier(std::chrono::seconds(30), true);
  timed.monitored_barrier();
  comm.barrier();  // the parent still works
}

template <class C>
void object_collectives(C& comm) {
  const int r = comm.rank(), p = comm.size();
  struct Stats {
    int rank;
    double loss;
  };
  const auto all = comm.all_gather_object(Stats{r, r * 0.5});
  MP_EXPECT(static_cast<int>(all.size()) == p, "all_gather_object size");
  for (int k = 0; k < p; ++k)
    MP_EXPECT(all[static_cast<std::size_t>(k)].rank == k &&
                  all[static_cast<std::size_t>(k)].loss == k * 0.5,
              "entry " << k);
  const std::vector<std::string> words(
      static_cast<std::size_t>(r + 1),
      std::string(static_cast<std::size_t>(r) * 1000, 'a' + static_cast<char>(r)));
  const auto gathered = comm.gather_object(words, p - 1);
  if (r == p - 1) {
    MP_EXPECT(static_cast<int>(gathered.size()) == p, "gather_object size");
    for (int k = 0; k < p; ++k) {
      MP_EXPECT(gathered[static_cast<std::size_t>(k)].size() == static_cast<std::size_t>(k + 1),
                "rank " << k << " words");
    }
  } else {
    MP_EXPECT(gathered.empty(), "non-root gets nothing");
  }
  std::pair<std::string, std::vector<int>> config;
  if (r == 0) config = {"lr=0.1", {1, 2, 3}};
  comm.broadcast_object(config, 0);
  MP_EXPECT(config.first == "lr=0.1" && config.second == std::vector<int>({1, 2, 3}),
            "broadcast_object");
  // scatter_object: rank k gets entry k of the root's list (sizes differ: 0 to 2k words).
  for (int root : {0, p - 1}) {
    std::vector<std::vector<std::string>> lists;
    if (r == root) {
      for (int k = 0; k < p; ++k)
        lists.emplace_back(static_cast<std::size_t>(2 * k),
                           std::string(static_cast<std::size_t>(k) * 300, 'x'));
    }
    const auto got = comm.scatter_object(lists, root);
    MP_EXPECT(got.size() == static_cast<std::size_t>(2 * r) &&
                  (got.empty() || got[0].size() == static_cast<std::size_t>(r) * 300),
              "scatter_object from root " << root);
  }
}

}  // namespace cases
