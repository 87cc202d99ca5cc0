// The Eigen adapter (ddp/adapters/eigen.hpp): Eigen::Matrix, Array and Map used unchanged by
// Communicator and GradientAverager across forked processes; strided expressions are not tensors.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <ddp/adapters/eigen.hpp>
#include <ddp/ddp.hpp>

#include <doctest/doctest.h>

#include <Eigen/Core>

#include <cmath>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using Comm = ddp::Communicator<ddp::backend::Host>;

// What is and is not a tensor, and where it lives, is known when the program is compiled.
static_assert(ddp::HostTensor<Eigen::MatrixXf>);
static_assert(ddp::HostTensor<Eigen::Matrix<double, 3, 4, Eigen::RowMajor>>);
static_assert(ddp::HostTensor<Eigen::ArrayXXd>);
static_assert(ddp::HostTensor<Eigen::VectorXi>);
static_assert(ddp::HostTensor<Eigen::Map<Eigen::VectorXf>>);
static_assert(ddp::MutableTensor<Eigen::Map<Eigen::VectorXf>>);
static_assert(ddp::TensorLike<Eigen::Map<const Eigen::VectorXf>>);
static_assert(!ddp::MutableTensor<Eigen::Map<const Eigen::VectorXf>>);
static_assert(!ddp::TensorLike<Eigen::Map<Eigen::VectorXf, 0, Eigen::InnerStride<2>>>);
static_assert(!ddp::TensorLike<Eigen::Block<Eigen::MatrixXf>>);
static_assert(ddp::tensor_dtype_v<Eigen::MatrixXd> == ddp::DType::float64);

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

void run(int world, const std::function<void(Comm&)>& body) {
  ddp::Options o;
  o.timeout = std::chrono::seconds(60);
  try {
    ddp::spawn(world, [&](ddp::Environment env) {
      auto comm = Comm::init(env, o);
      body(comm);
    });
  } catch (const ddp::Error& e) {
    FAIL_CHECK(std::string(e.what()));
  }
}

struct EigenParam {  // a model's parameter: Eigen matrices for the value and the gradient
  Eigen::MatrixXf* value;
  Eigen::MatrixXf* grad;
};

}  // namespace

template <>
struct ddp::parameter_traits<EigenParam> {
  static Eigen::MatrixXf& value(EigenParam& p) { return *p.value; }
  static Eigen::MatrixXf& grad(EigenParam& p) { return *p.grad; }
};

TEST_CASE("Eigen matrices, arrays and maps in collectives across 3 processes") {
  run(3, [](Comm& comm) {
    const int r = comm.rank(), p = comm.size();
    Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> m(4, 5);
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 5; ++j) m(i, j) = (r + 1) * (10 * i + j);
    comm.all_reduce(m);
    const int sum = p * (p + 1) / 2;
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 5; ++j) expect(m(i, j) == sum * (10 * i + j), "all_reduce of a Matrix");

    Eigen::ArrayXXf a = Eigen::ArrayXXf::Constant(3, 2, static_cast<float>(r));
    comm.broadcast(a, 2);
    expect((a == 2.0f).all(), "broadcast of an Array");

    std::vector<std::int32_t> storage(6, r);
    Eigen::Map<Eigen::VectorXi> map(storage.data(), 3);  // the first half only
    comm.all_reduce(map, ddp::ReduceOp::max);
    expect(storage[0] == p - 1 && storage[2] == p - 1 && storage[3] == r, "all_reduce of a Map");

    Eigen::VectorXf mine = Eigen::VectorXf::Constant(2, static_cast<float>(r));
    Eigen::VectorXf all(2 * p);
    comm.all_gather(mine, all);
    for (int q = 0; q < p; ++q) expect(all(2 * q) == static_cast<float>(q), "all_gather");
  });
}

TEST_CASE("GradientAverager over Eigen parameters") {
  run(2, [](Comm& comm) {
    const int r = comm.rank();
    Eigen::MatrixXf w = Eigen::MatrixXf::Constant(8, 3, static_cast<float>(r + 5));
    Eigen::MatrixXf gw = Eigen::MatrixXf::Constant(8, 3, static_cast<float>(2 * r));
    Eigen::MatrixXf b = Eigen::MatrixXf::Constant(3, 1, 1.0f);
    Eigen::MatrixXf gb = Eigen::MatrixXf::Constant(3, 1, static_cast<float>(r));
    std::vector<EigenParam> model{{&w, &gw}, {&b, &gb}};
    ddp::GradientAverager avg(comm, model);
    expect((w.array() == 5.0f).all(), "rank 0's values everywhere");
    avg.average();
    expect((gw.array() == 1.0f).all(), "weight gradient averaged");
    expect((gb.array() == 0.5f).all(), "bias gradient averaged");
  });
}
