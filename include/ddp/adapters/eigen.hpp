// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Eigen's dense types as ddp tensors: Eigen::Matrix, Eigen::Array (any size, either storage
/// order) and Eigen::Map of them without strides are host tensors, usable unchanged by
/// Communicator, GradientAverager and every other ddp API. The whole storage is the tensor (rows
/// times columns elements, in storage order: collectives are elementwise, so the order only
/// has to agree across ranks, which the type guarantees).
///
/// Expressions with strides (blocks, rows of a column-major matrix, strided maps) are not
/// contiguous and are not tensors: they do not compile with ddp (copy into a Matrix first).
/// Needs Eigen 3.3 or later on the include path (Debian: libeigen3-dev); only this header
/// depends on it.

#include "ddp/tensor.hpp"
#include "ddp/types.hpp"

#include <Eigen/Core>

#include <concepts>
#include <cstddef>
#include <type_traits>

DDP_BEGIN_NAMESPACE
namespace detail {

/// An owning, contiguous Eigen object (Matrix or Array) whose scalar ddp knows.
template <class E>
concept eigen_plain = std::derived_from<E, Eigen::PlainObjectBase<E>> && Scalar<typename E::Scalar>;

/// A map of contiguous memory as a Matrix or Array (the default stride).
template <class E>
inline constexpr bool is_eigen_dense_map_v = false;
template <class P, int Options>
inline constexpr bool is_eigen_dense_map_v<Eigen::Map<P, Options, Eigen::Stride<0, 0>>> =
    eigen_plain<std::remove_const_t<P>>;

template <class S, class E>
TensorView<S> eigen_view(E& e) noexcept {
  return {e.data(), static_cast<std::size_t>(e.size()), Device::cpu(), nullptr};
}

}  // namespace detail

/// Eigen::Matrix and Eigen::Array.
template <detail::eigen_plain E>
struct tensor_traits<E> {
  static constexpr DeviceKind device_kind = DeviceKind::cpu;  ///< Host memory.
  /// The coefficients, in storage order, as host memory.
  static TensorView<typename E::Scalar> view(E& e) noexcept {
    return detail::eigen_view<typename E::Scalar>(e);
  }
  /// The coefficients, in storage order, as read-only host memory.
  static TensorView<const typename E::Scalar> view(const E& e) noexcept {
    return detail::eigen_view<const typename E::Scalar>(e);
  }
};

/// Eigen::Map<Matrix or Array> without strides (Map<const ...> gives a read-only tensor).
template <class M>
  requires detail::is_eigen_dense_map_v<M>
struct tensor_traits<M> {
  /// The map's pointer type (to const for Map<const Matrix>).
  using Pointer = decltype(std::declval<M&>().data());
  static constexpr DeviceKind device_kind = DeviceKind::cpu;  ///< Host memory.
  /// The mapped coefficients as host memory (read-only for Map<const ...>).
  static TensorView<std::remove_pointer_t<Pointer>> view(M& m) noexcept {
    return detail::eigen_view<std::remove_pointer_t<Pointer>>(m);
  }
  /// The mapped coefficients as read-only host memory.
  static TensorView<const typename M::Scalar> view(const M& m) noexcept {
    return detail::eigen_view<const typename M::Scalar>(m);
  }
};

DDP_END_NAMESPACE
