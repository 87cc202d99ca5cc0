// What a worker leaves for its launcher (comm/error_file.hpp): torchrun's JSON, escaped, from
// ddp::record and from the terminate handler (the latter across real processes in
// tests/launch/test_ddprun.py).
#include <ddp/comm/error_file.hpp>

#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include "multiprocess.hpp"

namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("error file: JSON strings are escaped, control characters included") {
  CHECK(ddp::detail::json_quoted("plain") == "\"plain\"");
  CHECK(ddp::detail::json_quoted("a \"b\" \\ c\nd\te\x01") ==
        "\"a \\\"b\\\" \\\\ c\\nd\\te\\u0001\"");
}

TEST_CASE("error file: ddp::record writes the escaping exception in torchrun's format") {
  const mp::TempDir dir;
  const std::string file = dir.file("error.json");
  ::setenv("TORCHELASTIC_ERROR_FILE", file.c_str(), 1);
  CHECK(ddp::record([] { return 3; }) == 3);
  CHECK(read(file).empty());  // nothing written when nothing is thrown
  CHECK_THROWS_AS(ddp::record([]() -> int {
                    ddp::detail::fail(ddp::Errc::timeout, "rank 2: all_reduce #7 timed out");
                  }),
                  ddp::Error);
  const std::string json = read(file);
  CHECK(json.find("{\"message\": {\"message\": \"ddp::Error (timeout): rank 2: all_reduce #7 "
                  "timed out\", \"extraInfo\": {\"py_callstack\": ") == 0);
  CHECK_THROWS_AS(ddp::record([] { throw std::runtime_error("bad \"shape\""); }),
                  std::runtime_error);
  CHECK(read(file).find("\"std::runtime_error: bad \\\"shape\\\"\"") != std::string::npos);
  ::unsetenv("TORCHELASTIC_ERROR_FILE");
  CHECK_THROWS_AS(ddp::record([] { throw std::logic_error("x"); }), std::logic_error);
}
