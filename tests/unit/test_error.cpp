#include <ddp/ddp.hpp>

#include <doctest/doctest.h>

#include <cerrno>
#include <set>
#include <string>
#include <string_view>
#include <system_error>

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
