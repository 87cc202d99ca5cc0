// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// How ddp sees a user's tensor: a TensorView {data, size, device, stream}, obtained through one
/// customization point, ddp::view(t), which tries in order
///   1. a specialization of ddp::tensor_traits<T> with `static TensorView<E> view(T&)`,
///   2. a member function `t.ddp_view()` returning TensorView<E>,
///   3. any contiguous sized range (std::vector, std::array, std::span, C arrays): host memory.
/// A traits specialization may also say where the buffer lives at compile time:
///   static constexpr ddp::DeviceKind device_kind = ddp::DeviceKind::cuda;
/// so that a CUDA-only backend can reject host buffers when the program is compiled.
///
/// A framework tensor (torch::Tensor, an ONNX Runtime value, a TensorFlow or ggml tensor, an
/// Arrow array) knows its element type, device and layout only at run time: its adapter returns
/// a ddp::DynamicView instead of a TensorView, through the same two customization points, and
/// the communicator checks at run time what the compiler checks for a TensorView (the dtype and
/// the op, contiguity, the device, writability).

#include "ddp/config.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"
#include "ddp/types.hpp"

#include <concepts>
#include <cstddef>
#include <initializer_list>
#include <optional>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// A non-owning view of a tensor's contiguous elements: where they are (device), how many, and
/// for CUDA buffers the stream whose work produced them (a cudaStream_t, or nullptr for the
/// default stream). T may be const for read-only buffers.
template <class T>
struct TensorView {
  using element_type = T;                  ///< The element type, const for a read-only view.
  using value_type = std::remove_cv_t<T>;  ///< The element type without const.

  T* data = nullptr;       ///< The first element.
  std::size_t size = 0;    ///< The number of elements.
  Device device{};         ///< Where the elements are.
  void* stream = nullptr;  ///< CUDA: the stream whose work produced the data (nullptr: default)

  /// size * sizeof(T).
  [[nodiscard]] constexpr std::size_t bytes() const noexcept { return size * sizeof(T); }
  /// Whether size is 0.
  [[nodiscard]] constexpr bool empty() const noexcept { return size == 0; }
  /// The DType of the elements (dtype_of<value_type>).
  [[nodiscard]] static constexpr DType dtype() noexcept requires Scalar<value_type> {
    return dtype_of<value_type>;
  }

  /// Elements [offset, offset + count) on the same device and stream; throws
  /// Errc::invalid_argument when the range does not fit.
  [[nodiscard]] constexpr TensorView subview(std::size_t offset, std::size_t count) const {
    if (offset > size || count > size - offset) {
      detail::fail(Errc::invalid_argument, "TensorView::subview: elements [", offset, ", ", offset,
                   " + ", count, ") are outside a view of ", size, " elements");
    }
    return {data + offset, count, device, stream};
  }

  /// Host-side iteration (only meaningful when device.is_cpu()).
  ///@{
  [[nodiscard]] constexpr T* begin() const noexcept { return data; }
  [[nodiscard]] constexpr T* end() const noexcept { return data + size; }
  ///@}
  /// Element `i`, unchecked (only meaningful when device.is_cpu()).
  [[nodiscard]] constexpr T& operator[](std::size_t i) const noexcept { return data[i]; }

  /// A read-only view of the same elements.
  constexpr operator TensorView<const T>() const noexcept requires(!std::is_const_v<T>) {
    return {data, size, device, stream};
  }
};

/// `TensorView{ptr, n, ...}` deduces the element type from the pointer.
template <class T, class... Rest>
TensorView(T*, Rest...) -> TensorView<T>;

/// A view whose element type is known only at run time: what an adapter of a framework tensor
/// returns (see the file comment). Collectives check it when they are called and raise
/// Errc::invalid_argument naming the rank, the collective and the argument when it cannot be used.
struct DynamicView {
  void* data = nullptr;          ///< the first element
  std::size_t size = 0;          ///< elements
  DType dtype = DType::float32;  ///< the element type, as the framework reports it
  Device device{};               ///< where the elements are
  void* stream = nullptr;  ///< CUDA: the stream whose work produced the data (nullptr: default)
  /// The elements are dense and in order, so `size` of them from `data` are the tensor. A
  /// collective refuses a view that is not (it would read or write the wrong elements).
  bool contiguous = true;
  /// The tensor may be read, not written: refused as a collective's output.
  bool read_only = false;
  /// Why this tensor cannot be used at all, in the framework's words (e.g. "an undefined
  /// torch::Tensor", "torch dtype ComplexFloat has no ddp::DType"); nullptr when it can. The
  /// collective's error carries it.
  const char* problem = nullptr;

  /// Bytes of the elements (0 for an invalid dtype).
  [[nodiscard]] constexpr std::size_t bytes() const noexcept { return size * size_of(dtype); }
};

/// The customization point. The primary template is empty; specialize it (fully, or partially
/// with constraints) for your tensor type:
///
///   template <> struct ddp::tensor_traits<MyTensor> {
///     static constexpr ddp::DeviceKind device_kind = ddp::DeviceKind::cuda;  // optional
///     static constexpr bool shares_storage = true;                         // optional
///     static ddp::TensorView<float> view(MyTensor& t) {
///       return {t.ptr(), t.numel(), ddp::Device::cuda(t.device()), t.stream()};
///     }
///     static ddp::TensorView<const float> view(const MyTensor& t) { ... }  // optional
///   };
///
/// `shares_storage`: a copy of the tensor refers to the same memory and keeps it alive (a
/// reference-counted handle, like torch::Tensor). The Work of an _async collective then holds a
/// copy until the operation has finished, so the caller may drop its own before wait(). Types
/// without it (std::vector, std::array, spans, ddp::CudaBuffer, TensorView, DynamicView) are used
/// in place: they must outlive the Work.
template <class T>
struct tensor_traits {};

template <class T>
struct From;
template <class T>
struct Into;

/// A TensorView passes through unchanged (keeping its device and stream); where it lives is known
/// only at run time.
template <class T>
struct tensor_traits<TensorView<T>> {
  /// `v` itself.
  static constexpr TensorView<T> view(const TensorView<T>& v) noexcept { return v; }
};

namespace detail {

/// Whether T's traits say that a copy of a T shares (and keeps alive) its storage.
template <class T>
concept shares_storage = requires {
  requires tensor_traits<T>::shares_storage == true;
}
&&std::is_copy_constructible_v<T>;

template <class T>
inline constexpr bool is_tensor_view_v = false;
template <class T>
inline constexpr bool is_tensor_view_v<TensorView<T>> = true;

template <class V>
concept dynamic_view_type = std::is_same_v<std::remove_cvref_t<V>, DynamicView>;

/// What a customization point may return: a TensorView<E> or a DynamicView.
template <class V>
concept tensor_view_type = is_tensor_view_v<std::remove_cvref_t<V>> || dynamic_view_type<V>;

template <class T>
concept has_traits_view = requires(T& t) {
  { tensor_traits<std::remove_cvref_t<T>>::view(t) } -> tensor_view_type;
};

template <class T>
concept has_member_view = requires(T& t) {
  { t.ddp_view() } -> tensor_view_type;
};

template <class T>
concept contiguous_sized_range = std::ranges::contiguous_range<T&> && std::ranges::sized_range<T&>;

struct view_fn {
  template <class T>
    requires has_traits_view<T>
  constexpr auto operator()(T& t) const { return tensor_traits<std::remove_cvref_t<T>>::view(t); }

  template <class T>
    requires(!has_traits_view<T> && has_member_view<T>)
  constexpr auto operator()(T& t) const { return t.ddp_view(); }

  template <class T>
    requires(!has_traits_view<T> && !has_member_view<T> && contiguous_sized_range<T>)
  constexpr auto operator()(T& t) const {
    using E = std::remove_reference_t<std::ranges::range_reference_t<T&>>;
    return TensorView<E>{std::ranges::data(t), static_cast<std::size_t>(std::ranges::size(t)),
                         Device::cpu(), nullptr};
  }
};

template <class T>
constexpr std::optional<DeviceKind> static_device_kind() {
  using U = std::remove_cvref_t<T>;
  if constexpr (has_traits_view<T>) {
    if constexpr (requires { tensor_traits<U>::device_kind; }) {
      return DeviceKind{tensor_traits<U>::device_kind};
    } else {
      return std::nullopt;
    }
  } else if constexpr (has_member_view<T>) {
    if constexpr (requires { U::ddp_device_kind; }) {
      return DeviceKind{U::ddp_device_kind};
    } else {
      return std::nullopt;
    }
  } else {
    return DeviceKind::cpu;
  }
}

}  // namespace detail

/// ddp::view(t): the TensorView of any adapted tensor (see the file comment for the order).
inline constexpr detail::view_fn view{};

/// Anything ddp::view accepts, whatever its element type.
template <class T>
concept Viewable = requires(std::remove_reference_t<T>& t) {
  ddp::view(t);
};

/// The view type of T: TensorView<float> for std::vector<float>, DynamicView for a tensor whose
/// adapter returns one.
template <Viewable T>
using tensor_view_t = decltype(ddp::view(std::declval<std::remove_reference_t<T>&>()));

/// A tensor whose element type is known only at run time (its view is a ddp::DynamicView).
template <class T>
concept DynamicTensor = Viewable<T> && detail::dynamic_view_type<tensor_view_t<T>>;

/// The element type of T's view, without const (types with a compile-time element type).
template <Viewable T>
  requires(!DynamicTensor<T>)
using tensor_value_t = typename tensor_view_t<T>::value_type;

namespace detail {
/// What stands for the element type of a DynamicTensor (known only at run time).
struct DynamicElement {};
template <class T, bool Dynamic = DynamicTensor<T>>
struct element_type_of {
  using type = typename tensor_view_t<T>::element_type;
};
template <class T>
struct element_type_of<T, true> {
  using type = DynamicElement;
};
}  // namespace detail

/// The element type of T's view, const where the view is read-only (detail::DynamicElement for
/// a DynamicTensor: its writability is checked at run time).
template <Viewable T>
using tensor_element_type_t = typename detail::element_type_of<T>::type;

/// A buffer collectives accept: viewable, with a Scalar element type (see ddp::Scalar), or a
/// DynamicTensor (its element type is checked when the collective is called).
template <class T>
concept TensorLike = Viewable<T> &&(DynamicTensor<T> || Scalar<tensor_value_t<T>>);

/// A TensorLike whose elements may be written (the output of a collective); a DynamicTensor's
/// writability is checked when the collective is called.
template <class T>
concept MutableTensor = TensorLike<T> && !std::is_const_v<tensor_element_type_t<T>>;

namespace detail {
template <class>
inline constexpr bool always_false = false;

/// A range whose elements are not objects in memory (std::vector<bool>, a transforming view).
template <class U>
concept proxy_range =
    std::ranges::range<U&> && !std::is_lvalue_reference_v<std::ranges::range_reference_t<U&>>;

/// A framework tensor whose adapter is not included (libtorch's at::Tensor: data_ptr, numel,
/// scalar_type, is_contiguous), to name the adapter in the error.
template <class U>
concept unadapted_torch_tensor = requires(const U& t) {
  t.data_ptr();
  t.numel();
  t.scalar_type();
  t.is_contiguous();
};

/// A range whose elements are tensors themselves (std::vector<torch::Tensor>, a vector of
/// vectors): a list of buffers where a collective takes one.
template <class U>
concept range_of_tensors = std::ranges::range<U&> &&
    (Viewable<std::ranges::range_value_t<U&>> ||
     unadapted_torch_tensor<std::ranges::range_value_t<U&>>);

template <class T>
inline constexpr bool is_from_v = false;
template <class T>
inline constexpr bool is_from_v<From<T>> = true;
template <class T>
inline constexpr bool is_into_v = false;
template <class T>
inline constexpr bool is_into_v<Into<T>> = true;

/// True when T can be a collective's argument (written to when Output); otherwise the first
/// error the compiler prints says why, instead of "no matching function" and 20 lines of
/// unsatisfied constraints. The collectives' template parameters use it (tensor_input /
/// tensor_output below), so a wrong type is a hard error there, not a silent non-match.
template <class T, bool Output>
consteval bool explain_tensor_argument() {
  using U = std::remove_reference_t<T>;
  if constexpr (!Output && is_into_v<std::remove_cv_t<U>>) {
    static_assert(always_false<T>,
                  "ddp: ddp::into(...) is given where the collective reads its input: the "
                  "arguments are in torch's order (out, in); ddp's collectives take "
                  "(ddp::from(in), ddp::into(out)), the input first, as MPI does: swap them");
  } else if constexpr (Output && is_from_v<std::remove_cv_t<U>>) {
    static_assert(always_false<T>,
                  "ddp: ddp::from(...) is given where the collective writes its result: the "
                  "arguments are in torch's order (out, in), or an in-place buffer is marked as "
                  "an input; ddp's collectives take (ddp::from(in), ddp::into(out)), the input "
                  "first, as MPI does");
  } else if constexpr (Output ? MutableTensor<T> : TensorLike<T>) {
    return true;
  } else if constexpr (!Viewable<T> && proxy_range<U>) {
    static_assert(always_false<T>,
                  "ddp: this range has no elements in memory to send (std::vector<bool> packs "
                  "bits; a view computes its values): for flags use a bool array "
                  "(std::array<bool, N>, std::unique_ptr<bool[]> in a std::span), or copy the "
                  "values into a std::vector");
  } else if constexpr (!Viewable<T> && std::ranges::range<U&> &&
                       !std::ranges::contiguous_range<U&>) {
    static_assert(always_false<T>,
                  "ddp: this range is not contiguous (std::list, std::deque, std::set, std::map, "
                  "...): a collective moves one block of memory; copy the values into a "
                  "std::vector, or give ddp::tensor_traits<T> a view() of the memory");
  } else if constexpr (range_of_tensors<U>) {
    static_assert(always_false<T>,
                  "ddp: this is a list of tensors, and a collective takes one buffer: "
                  "all_reduce_coalesced(tensors) (and all_reduce_coalesced_async) reduces several "
                  "in one operation; otherwise call the collective once per tensor");
  } else if constexpr (!Viewable<T> && unadapted_torch_tensor<U>) {
    static_assert(always_false<T>,
                  "ddp: a torch::Tensor needs the libtorch adapter: #include "
                  "<ddp/adapters/torch.hpp> (and link ddp::torch)");
  } else if constexpr (!Viewable<T>) {
    static_assert(always_false<T>,
                  "ddp: this type is not a tensor ddp knows: specialize ddp::tensor_traits<T> "
                  "(in namespace ddp, visible where the collective is called) with static "
                  "ddp::TensorView<E> view(T&), or give T a member ddp_view(); see ddp/tensor.hpp "
                  "and the README's 'Adapting your tensor type'");
  } else if constexpr (!DynamicTensor<T> && !Scalar<tensor_value_t<T>>) {
    static_assert(always_false<T>,
                  "ddp: the element type is not one a collective carries; ddp carries int8, "
                  "int16, int32, int64, uint8, uint16, uint32, uint64, bool, ddp::half, "
                  "ddp::bfloat16, float and double (not char, long double or std::complex: a "
                  "std::complex<float> buffer travels as a std::span<float> of twice the size)");
  } else {
    static_assert(always_false<T>,
                  "ddp: this argument is written to, but its elements are const: pass a "
                  "non-const buffer");
  }
  return false;
}

/// A collective's input: TensorLike, else a compile error that says why.
template <class T>
concept tensor_input = explain_tensor_argument<T, false>();
/// A collective's output: MutableTensor, else a compile error that says why.
template <class T>
concept tensor_output = explain_tensor_argument<T, true>();
}  // namespace detail

/// Where T's buffer lives if its type says so: DeviceKind::cpu for ranges, the traits'
/// device_kind for adapted types, std::nullopt when only the TensorView knows (at run time).
template <Viewable T>
inline constexpr std::optional<DeviceKind> static_device_kind_v = detail::static_device_kind<T>();

/// A TensorLike whose type says its buffer is on a CUDA device.
template <class T>
concept CudaTensor = TensorLike<T> &&(static_device_kind_v<T> == DeviceKind::cuda);

/// A TensorLike whose type says its buffer is host memory (every std container and range).
template <class T>
concept HostTensor = TensorLike<T> &&(static_device_kind_v<T> == DeviceKind::cpu);

/// The DType of T's elements: tensor_dtype_v<std::vector<float>> == DType::float32 (types with
/// a compile-time element type).
template <TensorLike T>
  requires(!DynamicTensor<T>)
inline constexpr DType tensor_dtype_v = dtype_of<tensor_value_t<T>>;

namespace detail {
/// A contiguous range of integers (not bool): element counts, one per rank.
template <class R>
concept count_range = std::ranges::contiguous_range<const R&> &&
    std::integral<std::remove_cv_t<std::ranges::range_value_t<const R&>>> &&
    !std::same_as<std::remove_cv_t<std::ranges::range_value_t<const R&>>, bool>;
}  // namespace detail

/// The element counts of a collective of uneven sizes, one per rank: any contiguous range of
/// integers (std::vector<std::size_t>, torch's split sizes as std::vector<std::int64_t> or
/// std::vector<int>, a std::span, a braced list). The collective refuses a negative count
/// (Errc::invalid_argument). Other types than std::size_t are copied.
class Counts {
 public:
  /// The counts in `r`: viewed when they are std::size_t (`r` must outlive the call), copied
  /// from any other integer type.
  template <detail::count_range R>
  Counts(const R& r) {  // NOLINT(google-explicit-constructor): converts as a span would
    using V = std::remove_cv_t<std::ranges::range_value_t<const R&>>;
    if constexpr (std::same_as<V, std::size_t>) {
      view_ = std::span<const std::size_t>(std::ranges::data(r), std::ranges::size(r));
    } else {
      // A negative count wraps to a value above any buffer's size, which the collective's
      // checks name (with the rank and the collective) as negative.
      own_.reserve(static_cast<std::size_t>(std::ranges::size(r)));
      for (const V v : r) own_.push_back(static_cast<std::size_t>(v));
      view_ = own_;
    }
  }
  /// The counts of a braced list, copied.
  Counts(std::initializer_list<std::size_t> c);
  /// A copy (it views what `o` views, or owns a copy of what `o` owns).
  Counts(const Counts& o);
  Counts& operator=(const Counts&) = delete;
  ~Counts() = default;

  /// The counts.
  [[nodiscard]] std::span<const std::size_t> span() const noexcept { return view_; }
  /// The counts, where a std::span is taken.
  operator std::span<const std::size_t>() const noexcept { return view_; }  // NOLINT

 private:
  [[nodiscard]] bool owns() const noexcept { return view_.data() == own_.data(); }
  std::vector<std::size_t> own_;
  std::span<const std::size_t> view_;
};

/// One operation of Communicator::batch_isend_irecv (torch's dist.P2POp): P2POp::send(t, peer)
/// or P2POp::recv(t, peer), with a tag. It refers to the tensor's memory, which must stay alive
/// and untouched until the batch's Work completes.
struct P2POp {
  bool is_send = true;  ///< a send (else a receive)
  DynamicView buf{};    ///< the tensor's memory
  int peer = 0;         ///< the other rank
  int tag = 0;          ///< matched with the peer's, as send/recv's

  /// Sends `t` to `peer`.
  template <detail::tensor_input T>
  [[nodiscard]] static P2POp send(T&& t, int peer, int tag = 0) {
    return {true, erased(t), peer, tag};
  }
  /// Receives into `t` from `peer`.
  template <detail::tensor_output T>
  [[nodiscard]] static P2POp recv(T&& t, int peer, int tag = 0) {
    return {false, erased(t), peer, tag};
  }

 private:
  template <class T>
  static DynamicView erased(T& t) {
    if constexpr (DynamicTensor<T>) {
      return ddp::view(t);
    } else {
      const auto v = ddp::view(t);
      using E = typename decltype(v)::element_type;
      using M = std::remove_const_t<E>;
      return DynamicView{const_cast<M*>(v.data), v.size, dtype_of<M>, v.device, v.stream, true,
                         std::is_const_v<E>};
    }
  }
};

/// A collective's input with its role named: `comm.all_gather(ddp::from(mine), ddp::into(all))`
/// (as KaMPIng's `send_buf`). ddp's buffer-pair collectives take the input first, as MPI does;
/// torch's take the output first. Written with from() and into(), an argument in the wrong
/// place is a compile error that says so (detail::explain_tensor_argument), where two plain
/// buffers of one type would be accepted in either order. Holds a reference to `tensor`, or a
/// copy of a tensor whose copies share its storage (torch::Tensor), so that an async call keeps
/// that storage alive as it would the tensor itself.
template <class T>
struct From {
  T tensor;  ///< The tensor (a reference, or a storage-sharing copy).
};
/// A collective's output with its role named: see ddp::From.
template <class T>
struct Into {
  T tensor;  ///< The tensor (a reference, or a storage-sharing copy).
};

namespace detail {
/// How a role wrapper holds `T&&`: a storage-sharing tensor by value, anything else by
/// reference (an rvalue by value: the wrapper lives as long as the call's argument would).
template <class T>
using role_held_t =
    std::conditional_t<shares_storage<std::remove_cvref_t<T>>, std::remove_cvref_t<T>, T>;

/// tensor_traits of a role wrapper: the wrapped tensor's view, device kind and storage sharing.
template <class T>
struct role_traits {
  static constexpr bool shares_storage = !std::is_reference_v<T> && detail::shares_storage<T>;
};
template <class T>
  requires(static_device_kind<std::remove_reference_t<T>>().has_value())
struct role_traits<T> {
  static constexpr bool shares_storage = !std::is_reference_v<T> && detail::shares_storage<T>;
  static constexpr DeviceKind device_kind = *static_device_kind<std::remove_reference_t<T>>();
};
}  // namespace detail

/// `in` as a collective's input (ddp::From).
template <class T>
  requires Viewable<T>
[[nodiscard]] constexpr From<detail::role_held_t<T>> from(T&& in) { return {std::forward<T>(in)}; }
/// `out` as a collective's output (ddp::Into).
template <class T>
  requires Viewable<T>
[[nodiscard]] constexpr Into<detail::role_held_t<T>> into(T&& out) {
  return {std::forward<T>(out)};
}

/// An input named by ddp::from: the wrapped tensor's view.
template <class T>
struct tensor_traits<From<T>> : detail::role_traits<T> {
  /// The wrapped tensor's view.
  static constexpr auto view(From<T>& f) { return ddp::view(f.tensor); }
  /// The same, for a wrapper held const.
  static constexpr auto view(const From<T>& f) { return ddp::view(f.tensor); }
};
/// An output named by ddp::into: the wrapped tensor's own view.
template <class T>
struct tensor_traits<Into<T>> : detail::role_traits<T> {
  /// The wrapped tensor's view.
  static constexpr auto view(Into<T>& i) { return ddp::view(i.tensor); }
  /// The same, for a wrapper held const (the wrapped tensor keeps its own constness).
  static constexpr auto view(const Into<T>& i) { return ddp::view(i.tensor); }
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/impl/tensor.ipp"
#endif
