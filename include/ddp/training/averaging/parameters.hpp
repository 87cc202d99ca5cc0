// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// What a model is to the averagers: the Parameter and Model concepts, and how a parameter type
/// is adapted. A Model is a sized range of parameters, or has parameters() returning one (and
/// may have buffers(): state such as BatchNorm's running statistics). A parameter has a value and
/// a gradient, mutable tensors of one floating-point type: members `value` and `grad` (data or
/// functions), or a ddp::parameter_traits<P> specialization, by which a framework's adapter also
/// says how its gradients are made and when they are final (ddp/adapters/torch_training.hpp).

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/tensor.hpp"
#include "ddp/types.hpp"
#if DDP_HAS_CUDA
#include "ddp/cuda.hpp"
#endif

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// Adapts a parameter type: specialize with static value(P&) and grad(P&) returning tensors.
/// Optional, for frameworks: ensure_grad(P&) and has_grad(P&) (gradients made lazily: see
/// detail::lazy_grad) and ready_hook(P&, std::function<void()>) (see detail::has_ready_hook);
/// point(P&, std::span<T> value, std::span<T> grad) re-points a parameter at other memory (used
/// by FullyShard, ddp/training/fully_sharded/fully_shard.hpp).
template <class P>
struct parameter_traits {};

namespace detail {

template <class P>
concept has_value = (
    requires(P & p) { parameter_traits<P>::value(p); } || requires(P & p) { p.value(); } ||
    requires(P & p) { p.value; });
template <class P>
concept has_grad = (
    requires(P & p) { parameter_traits<P>::grad(p); } || requires(P & p) { p.grad(); } ||
    requires(P & p) { p.grad; });

template <has_value P>
decltype(auto) param_value(P& p) {
  if constexpr (requires { parameter_traits<P>::value(p); })
    return parameter_traits<P>::value(p);
  else if constexpr (requires { p.value(); })
    return p.value();
  else
    return (p.value);
}

template <has_grad P>
decltype(auto) param_grad(P& p) {
  if constexpr (requires { parameter_traits<P>::grad(p); })
    return parameter_traits<P>::grad(p);
  else if constexpr (requires { p.grad(); })
    return p.grad();
  else
    return (p.grad);
}

template <class M>
decltype(auto) model_parameters(M& m) {
  if constexpr (requires { m.parameters(); })
    return m.parameters();
  else
    return (m);
}

/// The parameter type of model M.
template <class M>
using param_of_t = std::ranges::range_value_t<decltype(model_parameters(std::declval<M&>()))>;

/// Creates parameter p's gradient as zeros where the framework makes them lazily (libtorch:
/// before the first backward, or after zero_grad() set them to None), before the averager reads
/// it: parameter_traits<P>::ensure_grad(p), where defined.
template <class P>
void ensure_grad(P& p) {
  if constexpr (requires { parameter_traits<P>::ensure_grad(p); })
    parameter_traits<P>::ensure_grad(p);
}

/// Parameter p's rows when its values are seen as a matrix, row-major (torch: p.size(0) of a
/// tensor of 2 or more dimensions, the rest making the columns): parameter_traits<P>::rows(p) or
/// p.rows(), where defined; 0 (a vector) otherwise. Comm hooks that work on matrices (PowerSGD)
/// read it from BucketPiece::rows.
template <class P>
std::size_t param_rows(P& p) {
  if constexpr (requires { parameter_traits<P>::rows(p); })
    return static_cast<std::size_t>(parameter_traits<P>::rows(p));
  else if constexpr (requires { p.rows(); })
    return static_cast<std::size_t>(p.rows());
  else
    return 0;
}

/// Gradients a framework makes lazily: parameter_traits<P>::has_grad(p) says whether p has one
/// yet. The averager then looks it up when its bucket starts (made by then, or the parameter was
/// unused this step and gets zeros) instead of making zeros for backward to add into.
template <class P>
concept lazy_grad = requires(P& p) {
  parameter_traits<P>::ensure_grad(p);
  { parameter_traits<P>::has_grad(p) } -> std::convertible_to<bool>;
};

/// The framework calls back when p's gradient is final for this backward pass:
/// parameter_traits<P>::ready_hook(p, std::function<void()>) returns a handle whose destruction
/// removes the hook (libtorch: a post hook on the gradient's accumulator).
template <class P>
concept has_ready_hook = requires(P& p, std::function<void()> f) {
  {
    parameter_traits<P>::ready_hook(p, std::move(f))
    } -> std::convertible_to<std::shared_ptr<void>>;
};

/// The model has buffers() (state that is not parameters): copied from rank 0 like them.
template <class M>
concept has_buffers = requires(M& m) {
  requires std::ranges::range<decltype(m.buffers())>;
  requires MutableTensor<std::ranges::range_reference_t<decltype(m.buffers())>>;
};

template <class T>
inline constexpr bool is_floating_scalar_v =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, half> ||
    std::is_same_v<T, bfloat16>;

template <class P>
using value_of_t = decltype(param_value(std::declval<P&>()));
template <class P>
using grad_of_t = decltype(param_grad(std::declval<P&>()));

/// Value and gradient typed at compile time: the same floating-point element type.
template <class P>
concept typed_parameter =
    !DynamicTensor<value_of_t<P>> && !DynamicTensor<grad_of_t<P>> &&
    std::is_same_v<tensor_value_t<value_of_t<P>>, tensor_value_t<grad_of_t<P>>> &&
    is_floating_scalar_v<tensor_value_t<grad_of_t<P>>>;

/// Value and gradient typed at run time (a framework's tensors): checked at construction.
template <class P>
concept dynamic_parameter = DynamicTensor<value_of_t<P>> && DynamicTensor<grad_of_t<P>>;

}  // namespace detail

/// A parameter: a value and a gradient, mutable tensors of the same floating-point type (checked
/// when the averager is made, for tensors typed at run time).
template <class P>
concept Parameter = requires(P& p) {
  { detail::param_value(p) } -> MutableTensor;
  { detail::param_grad(p) } -> MutableTensor;
}
&&(detail::typed_parameter<P> || detail::dynamic_parameter<P>);

/// A model: a sized range of Parameters, or something whose parameters() returns one.
template <class M>
concept Model = requires(M& m) {
  requires std::ranges::sized_range<decltype(detail::model_parameters(m))>;
  requires Parameter<std::ranges::range_value_t<decltype(detail::model_parameters(m))>>;
};

namespace detail {

/// True when M is a Model; otherwise the first error the compiler prints says what to change
/// (the averagers' deduction guides use it), instead of 50 lines of unsatisfied constraints.
template <class M>
consteval bool explain_model() {
  if constexpr (Model<M>) {
    return true;
  } else if constexpr (requires(M & m) {
                         m.get();
                         *m;
                         requires Model<std::remove_reference_t<decltype(*m)>>;
                       }) {
    static_assert(
        always_false<M>,
        "ddp: pass the model itself, *model: this is a pointer to it (a std::shared_ptr, "
        "or libtorch's TORCH_MODULE holder); the averager keeps a reference to the model");
  } else if constexpr (!requires(M & m) {
                         requires std::ranges::sized_range<decltype(model_parameters(m))>;
                       }) {
    static_assert(always_false<M>,
                  "ddp: this is not a model ddp knows: give the averager a sized range of "
                  "parameters (e.g. std::vector<P>), or an object whose parameters() returns "
                  "one (a torch::nn::Module with ddp/adapters/torch.hpp)");
  } else {
    static_assert(always_false<M>,
                  "ddp: the model's parameters are not ddp::Parameters: each needs a value and a "
                  "grad, mutable tensors of one floating-point type, as members (.value, .grad "
                  "or value(), grad()) or through a specialization of ddp::parameter_traits<P> "
                  "with static value(P&) and grad(P&) (ddp/training/averaging/parameters.hpp)");
  }
  return false;
}

/// What an averager of a type that is not a Model is deduced to, after the error that says why:
/// a valid model, whose averager takes any argument (a constructor declared, never defined), so
/// that the compiler stops at that one error instead of listing every constructor it tried.
struct rejected_parameter {
  std::vector<float> value, grad;  ///< a Parameter's members
};
/// See rejected_parameter.
struct rejected_model : std::vector<rejected_parameter> {};

/// An averager's model type: M when it is a Model, else a compile error that says why (the
/// averagers' deduction guides return Averager<model_t<M>, ...>, so both g++ and clang++ print
/// the reason first, and nothing after it).
template <class M>
using model_t = std::conditional_t<explain_model<M>(), M, rejected_model>;

/// The element type an averager of M uses by default: the gradients' type, or float32 where it
/// is known only at run time (then checked at construction) or where P is no Parameter (the
/// deduction guide has then said why).
template <class M, class P = param_of_t<M>, bool = dynamic_parameter<P> || !Parameter<P>>
struct model_element {
  using type = tensor_value_t<grad_of_t<P>>;
};
template <class M, class P>
struct model_element<M, P, true> {
  using type = float;
};

/// A parameter's value or gradient as a TensorView<T>: a run-time-typed one is checked here.
template <class T, class X>
TensorView<T> typed_view(X& x, int rank, std::size_t i, const char* what, const char* who) {
  const auto v = ddp::view(x);
  if constexpr (std::is_same_v<std::remove_cvref_t<decltype(v)>, DynamicView>) {
    if (v.problem != nullptr || !v.contiguous)
      fail(Errc::invalid_argument, "rank ", rank, ": ", who, ": parameter ", i, "'s ", what,
           " cannot be used: ", v.problem != nullptr ? v.problem : "it is not contiguous");
    if (v.dtype != dtype_of<T>)
      fail(Errc::invalid_argument, "rank ", rank, ": ", who, ": parameter ", i, "'s ", what, " is ",
           to_string(v.dtype), " but parameter 0's gradient is ", to_string(dtype_of<T>), "; the ",
           who, " takes one floating-point dtype per model");
    return {static_cast<T*>(v.data), v.size, v.device, v.stream};
  } else {
    return {v.data, v.size, v.device, v.stream};
  }
}

/// Every rank has the same parameters (count, element type T, sizes) and the same `options`
/// (bucket_bytes, first_bucket_bytes, in_place_bytes, broadcast_parameters, compression, the
/// fields of `options_name`): Errc::mismatch names the first difference and the ranks.
/// Collective.
template <class T, class Comm>
void check_same_parameters(Comm& comm, const std::vector<TensorView<T>>& values,
                           const std::vector<TensorView<T>>& grads, const char* who,
                           const char* options_name, std::array<std::uint64_t, 5> options) {
  std::vector<std::uint64_t> sig{grads.size(), static_cast<std::uint64_t>(dtype_of<T>)};
  sig.insert(sig.end(), options.begin(), options.end());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].size != values[i].size)
      fail(Errc::invalid_argument, "rank ", comm.rank(), ": ", who, ": parameter ", i, " has ",
           values[i].size, " values but ", grads[i].size, " gradients");
    sig.push_back(grads[i].size);
  }
  static constexpr const char* names[] = {"bucket_bytes", "first_bucket_bytes", "in_place_bytes",
                                          "broadcast_parameters", "compression"};
  const auto all = comm.all_gather_object(sig);
  for (std::size_t r = 1; r < all.size(); ++r) {
    const auto &a = all[0], &b = all[r];
    const auto differ = [&](const auto&... what) {
      fail(Errc::mismatch, "rank ", comm.rank(), ": ", who, ": ", what..., " on rank ", r,
           "; every rank must build the same model and give the same ", options_name);
    };
    if (a[0] != b[0]) differ("rank 0 has ", a[0], " parameters but ", b[0]);
    if (a[1] != b[1])
      differ("the gradients are ", to_string(static_cast<DType>(a[1])), " on rank 0 but ",
             to_string(static_cast<DType>(b[1])));
    for (std::size_t k = 7; k < a.size(); ++k)
      if (a[k] != b[k])
        differ("parameter ", k - 7, " has ", a[k], " elements on rank 0 but ", b[k]);
    for (std::size_t k = 2; k < 7; ++k)
      if (a[k] != b[k])
        differ(options_name, "::", names[k - 2], " is ", a[k], " on rank 0 but ", b[k]);
  }
}

#if !DDP_HAS_CUDA  // host memory only: the copies of ddp/cuda.hpp without their CUDA half
DDP_INLINE void copy_bytes(void* dst, const void* src, std::size_t n, bool, void*);
DDP_INLINE void zero_bytes(void* dst, std::size_t n, bool, void*);
inline void sync_stream(bool, void*) {}
inline void join_streams(bool, void*, void*) {}
#endif

}  // namespace detail

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/training/averaging/impl/parameters.ipp"
#endif
