#include <ddp/version.hpp>

#include <doctest/doctest.h>

#include <string>

TEST_CASE("version string matches the version macros") {
  const auto v = ddp::version_info();
  CHECK(v.major == DDP_VERSION_MAJOR);
  CHECK(v.minor == DDP_VERSION_MINOR);
  CHECK(v.patch == DDP_VERSION_PATCH);
  const std::string expected =
      std::to_string(v.major) + "." + std::to_string(v.minor) + "." + std::to_string(v.patch);
  CHECK(ddp::version() == expected);
  CHECK(DDP_VERSION == v.major * 10000 + v.minor * 100 + v.patch);
  static_assert(ddp::version().size() >= 5, "version() is usable in constant expressions");
}
