#include <ddp/tensor.hpp>

#include <doctest/doctest.h>

#include <array>
#include <deque>
#include <list>
#include <span>
#include <string>
#include <vector>

namespace user {

// A user tensor living on a CUDA device, adapted by a traits specialization. No CUDA is needed:
// ddp only carries the pointer, the device and the stream.
struct DeviceMatrix {
  float* ptr = nullptr;
  std::size_t rows = 0, cols = 0;
  int device = 0;
  void* stream = nullptr;
};

// A framework-style tensor: where it lives is a run-time property.
struct AnyTensor {
  std::vector<double> storage;
  bool on_gpu = false;
};

// A type adapted through a member function.
struct Grad {
  std::array<std::int32_t, 4> values{};
  ddp::TensorView<std::int32_t> ddp_view() { return {values.data(), values.size()}; }
};

// Same, but the member-function route also declares where it lives.
struct PinnedGrad {
  static constexpr ddp::DeviceKind ddp_device_kind = ddp::DeviceKind::cpu;
  std::vector<ddp::half> values;
  ddp::TensorView<ddp::half> ddp_view() { return {values.data(), values.size()}; }
};

// A type with both a member and traits: traits win.
struct Both {
  std::vector<float> a{1, 2, 3};
  std::vector<float> b{1};
  ddp::TensorView<float> ddp_view() { return {b.data(), b.size()}; }
};

}  // namespace user

template <>
struct ddp::tensor_traits<user::DeviceMatrix> {
  static constexpr ddp::DeviceKind device_kind = ddp::DeviceKind::cuda;
  static ddp::TensorView<float> view(user::DeviceMatrix& m) {
    return {m.ptr, m.rows * m.cols, ddp::Device::cuda(m.device), m.stream};
  }
};

template <>
struct ddp::tensor_traits<user::AnyTensor> {
  static ddp::TensorView<double> view(user::AnyTensor& t) {
    return {t.storage.data(), t.storage.size(),
            t.on_gpu ? ddp::Device::cuda(0) : ddp::Device::cpu(), nullptr};
  }
  static ddp::TensorView<const double> view(const user::AnyTensor& t) {
    return {t.storage.data(), t.storage.size(),
            t.on_gpu ? ddp::Device::cuda(0) : ddp::Device::cpu(), nullptr};
  }
};

template <>
struct ddp::tensor_traits<user::Both> {
  static ddp::TensorView<float> view(user::Both& t) { return {t.a.data(), t.a.size()}; }
};

// Standard containers.
static_assert(ddp::TensorLike<std::vector<float>>);
static_assert(ddp::TensorLike<std::vector<float>&>);
static_assert(ddp::TensorLike<std::array<double, 3>>);
static_assert(ddp::TensorLike<std::span<std::int64_t>>);
static_assert(ddp::TensorLike<std::span<const ddp::bfloat16, 8>>);
static_assert(ddp::TensorLike<float[16]>);
static_assert(ddp::HostTensor<std::vector<float>>);
static_assert(!ddp::CudaTensor<std::vector<float>>);
static_assert(ddp::MutableTensor<std::vector<float>>);
static_assert(ddp::TensorLike<const std::vector<float>>);
static_assert(!ddp::MutableTensor<const std::vector<float>>);
static_assert(!ddp::MutableTensor<std::span<const float>>);
static_assert(std::is_same_v<ddp::tensor_view_t<std::vector<float>>, ddp::TensorView<float>>);
static_assert(
    std::is_same_v<ddp::tensor_view_t<const std::vector<float>>, ddp::TensorView<const float>>);
static_assert(std::is_same_v<ddp::tensor_value_t<const std::vector<float>>, float>);
static_assert(ddp::tensor_dtype_v<std::vector<ddp::half>> == ddp::DType::float16);
// Not contiguous, or not a collective element type.
static_assert(!ddp::TensorLike<std::list<float>>);
static_assert(!ddp::TensorLike<std::deque<float>>);
static_assert(!ddp::TensorLike<std::vector<bool>>);
static_assert(!ddp::TensorLike<std::string>);
static_assert(!ddp::TensorLike<std::vector<std::string>>);
static_assert(!ddp::TensorLike<int>);
static_assert(ddp::Viewable<std::vector<char>> && !ddp::TensorLike<std::vector<char>>);
// Adapted types.
static_assert(ddp::CudaTensor<user::DeviceMatrix>);
static_assert(!ddp::HostTensor<user::DeviceMatrix>);
static_assert(ddp::TensorLike<user::AnyTensor>);
static_assert(!ddp::CudaTensor<user::AnyTensor> && !ddp::HostTensor<user::AnyTensor>);
static_assert(!ddp::static_device_kind_v<user::AnyTensor>.has_value());
static_assert(ddp::TensorLike<const user::AnyTensor>);
static_assert(!ddp::TensorLike<const user::DeviceMatrix>);  // traits give no const view
static_assert(ddp::TensorLike<user::Grad>);
static_assert(!ddp::static_device_kind_v<user::Grad>.has_value());
static_assert(ddp::HostTensor<user::PinnedGrad>);
static_assert(ddp::TensorLike<ddp::TensorView<float>>);
static_assert(!ddp::CudaTensor<ddp::TensorView<float>>);  // known only at run time

TEST_CASE("ranges are viewed as host memory") {
  std::vector<float> v{1, 2, 3};
  const auto tv = ddp::view(v);
  CHECK(tv.data == v.data());
  CHECK(tv.size == 3);
  CHECK(tv.bytes() == 12);
  CHECK(tv.device == ddp::Device::cpu());
  CHECK(tv.stream == nullptr);
  CHECK(tv.dtype() == ddp::DType::float32);
  tv[1] = 5;  // a mutable view writes through
  CHECK(v[1] == 5);

  double c_array[5] = {};
  CHECK(ddp::view(c_array).size == 5);
  std::array<std::int64_t, 2> arr{};
  CHECK(ddp::view(arr).data == arr.data());
  std::span<float> s(v.data() + 1, 2);
  CHECK(ddp::view(s).data == v.data() + 1);
  CHECK(ddp::view(s).size == 2);
  std::vector<float> empty;
  CHECK(ddp::view(empty).empty());
}

TEST_CASE("traits specialization carries device and stream") {
  float storage[6] = {};
  int stream_token = 0;
  user::DeviceMatrix m{storage, 2, 3, 1, &stream_token};
  const auto tv = ddp::view(m);
  CHECK(tv.data == storage);
  CHECK(tv.size == 6);
  CHECK(tv.device == ddp::Device::cuda(1));
  CHECK(tv.stream == &stream_token);

  user::AnyTensor t{{1.0, 2.0}, true};
  CHECK(ddp::view(t).device.is_cuda());
  const user::AnyTensor& ct = t;
  CHECK(ddp::view(ct).size == 2);
}

TEST_CASE("member ddp_view() is used when no traits exist, traits win over members") {
  user::Grad g;
  CHECK(ddp::view(g).data == g.values.data());
  CHECK(ddp::view(g).size == 4);
  user::Both b;
  CHECK(ddp::view(b).size == 3);
}

TEST_CASE("a TensorView passes through ddp::view unchanged") {
  float x[4] = {};
  ddp::TensorView<float> tv{x, 4, ddp::Device::cuda(2), &x};
  const auto again = ddp::view(tv);
  CHECK(again.data == x);
  CHECK(again.device == ddp::Device::cuda(2));
  CHECK(again.stream == &x);
}

TEST_CASE("subview checks its bounds, views convert to read-only") {
  std::vector<std::int32_t> v(10);
  const auto tv = ddp::view(v);
  const auto sub = tv.subview(2, 5);
  CHECK(sub.data == v.data() + 2);
  CHECK(sub.size == 5);
  CHECK(tv.subview(10, 0).empty());
  try {
    (void)tv.subview(8, 3);
    FAIL("subview accepted an out-of-range request");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
    CHECK(std::string(e.what()).find("outside a view of 10 elements") != std::string::npos);
  }
  CHECK_THROWS_AS((void)tv.subview(11, 0), ddp::Error);
  CHECK_THROWS_AS((void)tv.subview(1, std::size_t(-1)), ddp::Error);  // no overflow
  const ddp::TensorView<const std::int32_t> ro = tv;
  CHECK(ro.data == v.data());
  int sum = 0;
  for (auto x : ro) sum += x;
  CHECK(sum == 0);
  // Class template argument deduction.
  ddp::TensorView deduced{v.data(), v.size()};
  static_assert(std::is_same_v<decltype(deduced), ddp::TensorView<std::int32_t>>);
}
