#include <ddp/detail/collective.hpp>
#include <ddp/error.hpp>

#include <doctest/doctest.h>

#include <cerrno>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

TEST_CASE("Error carries its code and message") {
  const ddp::Error e(ddp::Errc::timeout, "rank 2: all_reduce timed out");
  CHECK(e.code() == ddp::Errc::timeout);
  CHECK(std::string_view(e.what()) == "rank 2: all_reduce timed out");
  const std::runtime_error& base = e;  // catchable as std::runtime_error
  CHECK(std::string_view(base.what()) == e.what());
}

TEST_CASE("every Errc has a distinct name and round-trips through std::error_code") {
  const ddp::Errc all[] = {
      ddp::Errc::invalid_argument, ddp::Errc::timeout,    ddp::Errc::peer_lost,
      ddp::Errc::mismatch,         ddp::Errc::backend,    ddp::Errc::aborted,
      ddp::Errc::system,           ddp::Errc::protocol,   ddp::Errc::unauthorized,
      ddp::Errc::address_in_use,   ddp::Errc::unsupported};
  std::set<std::string_view> names;
  for (auto c : all) {
    const auto name = ddp::to_string(c);
    CHECK(name != "unknown");
    names.insert(name);
    const std::error_code ec = c;  // implicit: Errc is an error code enum
    CHECK(bool(ec.category() == ddp::error_category()));
    CHECK(ec.message() == std::string(name));
    CHECK(bool(ec == c));
    CHECK(bool(ddp::Error(c, "x").error_code() == ec));
  }
  CHECK(names.size() == std::size(all));
  CHECK(std::string_view(ddp::error_category().name()) == "ddp");
  CHECK(ddp::to_string(static_cast<ddp::Errc>(999)) == "unknown");
}

TEST_CASE("detail::fail formats its parts into the message") {
  try {
    ddp::detail::fail(ddp::Errc::invalid_argument, "rank ", 3, ": broadcast: root ", -1,
                      " is not in [0, ", 4u, ")");
    FAIL("fail() returned");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
    CHECK(std::string_view(e.what()) == "rank 3: broadcast: root -1 is not in [0, 4)");
  }
}

TEST_CASE("detail::fail_errno names the call and the OS error") {
  try {
    ddp::detail::fail_errno(ENOENT, "shm_open(/ddp-x)");
    FAIL("fail_errno() returned");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::system);
    const std::string what = e.what();
    CHECK(what.find("shm_open(/ddp-x): ") == 0);
    CHECK(what.find("No such file or directory") != std::string::npos);
    CHECK(what.find("(errno 2)") != std::string::npos);
  }
}

TEST_CASE("fingerprint_digest: a change in any one field changes the digest, never 0") {
  using ddp::detail::Fingerprint;
  const Fingerprint base{
      7, 1000, -1, ddp::detail::Coll::all_reduce, ddp::DType::float32, ddp::ReduceOp::sum, 1};
  const std::uint32_t d0 = ddp::detail::fingerprint_digest(base);
  CHECK(d0 != 0);
  CHECK(ddp::detail::fingerprint_digest(base) == d0);  // deterministic: every rank agrees
  std::vector<Fingerprint> variants;
  for (std::uint64_t k = 1; k <= 64; ++k) {  // neighbouring and far sequence numbers and counts
    Fingerprint f = base;
    f.seq = base.seq + k;
    variants.push_back(f);
    f = base;
    f.count = base.count ^ (std::uint64_t{1} << (k - 1));
    variants.push_back(f);
  }
  for (int r = 0; r < 8; ++r) {
    Fingerprint f = base;
    f.root = r;
    variants.push_back(f);
  }
  for (auto c :
       {ddp::detail::Coll::broadcast, ddp::detail::Coll::reduce, ddp::detail::Coll::all_gather,
        ddp::detail::Coll::reduce_scatter, ddp::detail::Coll::barrier}) {
    Fingerprint f = base;
    f.coll = c;
    variants.push_back(f);
  }
  for (auto t : {ddp::DType::float64, ddp::DType::int32, ddp::DType::bfloat16}) {
    Fingerprint f = base;
    f.dtype = t;
    variants.push_back(f);
  }
  for (auto o : {ddp::ReduceOp::max, ddp::ReduceOp::avg}) {
    Fingerprint f = base;
    f.op = o;
    variants.push_back(f);
  }
  Fingerprint no_op = base;
  no_op.has_op = 0;
  variants.push_back(no_op);
  for (const Fingerprint& f : variants) {
    CAPTURE(ddp::detail::to_string(f));
    CHECK(ddp::detail::fingerprint_digest(f) != d0);
    CHECK(ddp::detail::fingerprint_digest(f) != 0);
  }
}
