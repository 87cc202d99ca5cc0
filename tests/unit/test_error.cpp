#include <ddp/backend/collective.hpp>
#include <ddp/error.hpp>

#include <doctest/doctest.h>

#include <cerrno>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
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

TEST_CASE("fingerprint_code: exact, never a hash: equal codes only for equal fields, else wide") {
  using ddp::detail::Fingerprint;
  using ddp::detail::fingerprint_code;
  using ddp::detail::fingerprint_wide;
  const Fingerprint base{
      7, 1000, -1, ddp::detail::Coll::all_reduce, ddp::DType::float32, ddp::ReduceOp::sum, 1};
  const std::uint64_t c0 = fingerprint_code(base, 6, true);
  CHECK(c0 != 0);
  CHECK(c0 != fingerprint_wide);
  CHECK(c0 < (std::uint64_t{1} << 48));
  CHECK(fingerprint_code(base, 6, true) == c0);                 // deterministic: every rank agrees
  CHECK(fingerprint_code(base, 0, false) == fingerprint_wide);  // a first checked round
  CHECK(fingerprint_code(base, 3, true) == fingerprint_wide);   // 4 collectives since the last
  CHECK(fingerprint_code(base, 8, true) == fingerprint_wide);   // the last one is ahead of it
  // Every pair of distinct fingerprints in the packed range gets distinct codes: all
  // combinations of a few values of each field, with the same previous sequence number.
  std::vector<Fingerprint> all;
  for (std::uint64_t seq : {6u, 7u, 8u, 9u})
    for (std::uint64_t count : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{23},
                                std::uint64_t{1758}, (std::uint64_t{1} << 28) - 1})
      for (int root : {-1, 0, 1, 30})
        for (auto c : {ddp::detail::Coll::all_reduce, ddp::detail::Coll::broadcast,
                       ddp::detail::Coll::barrier, ddp::detail::Coll::recv})
          for (auto t : {ddp::DType::int8, ddp::DType::float32, ddp::DType::uint16})
            for (auto o : {ddp::ReduceOp::sum, ddp::ReduceOp::avg})
              for (std::uint8_t has_op : {std::uint8_t{0}, std::uint8_t{1}})
                all.push_back({seq, count, root, c, t, o, has_op});
  std::unordered_map<std::uint64_t, std::size_t> seen;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const std::uint64_t code = fingerprint_code(all[i], 6, true);
    REQUIRE(code != fingerprint_wide);
    REQUIRE(code != 0);
    const auto inserted = seen.emplace(code, i);
    CAPTURE(ddp::detail::to_string(all[i]));
    CAPTURE(ddp::detail::to_string(all[inserted.first->second]));
    REQUIRE(inserted.second);
  }
  // What does not fit is wide (compared in full), never folded into a code another call has.
  std::vector<Fingerprint> wide(4, base);
  wide[0].count = std::uint64_t{1} << 28;
  wide[1].root = 31;
  wide[2].root = -2;
  wide[3].seq = 10;
  for (const Fingerprint& f : wide) {
    CAPTURE(ddp::detail::to_string(f));
    CHECK(fingerprint_code(f, 6, true) == fingerprint_wide);
  }
}

TEST_CASE("Error carries the rank that reported it first and the ranks lost, as fields") {
  const ddp::Error plain(ddp::Errc::timeout, "rank 1: barrier timed out");
  CHECK(plain.origin_rank() == -1);
  CHECK(plain.lost_ranks().empty());
  CHECK(plain.origin_message() == plain.what());

  const ddp::Error relayed(ddp::Errc::peer_lost,
                           "rank 0: all_reduce: failed because rank 3 reported: ", 3, "rank 2 died",
                           {2});
  CHECK(std::string_view(relayed.what()) ==
        "rank 0: all_reduce: failed because rank 3 reported: rank 2 died");
  CHECK(relayed.origin_rank() == 3);
  CHECK(relayed.origin_message() == "rank 2 died");
  CHECK(relayed.lost_ranks() == std::vector<int>{2});

  try {  // more context in front keeps every field
    ddp::detail::fail_within(relayed, "rank 0: enter: ");
    FAIL("fail_within() returned");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::peer_lost);
    CHECK(std::string_view(e.what()) ==
          "rank 0: enter: rank 0: all_reduce: failed because rank 3 reported: rank 2 died");
    CHECK(e.origin_rank() == 3);
    CHECK(e.origin_message() == "rank 2 died");
    CHECK(e.lost_ranks() == std::vector<int>{2});
  }
  try {
    ddp::detail::fail_from(-1, {4, 5}, ddp::Errc::peer_lost, "ranks ", 4, " and ", 5, " died");
    FAIL("fail_from() returned");
  } catch (const ddp::Error& e) {
    CHECK(std::string_view(e.what()) == "ranks 4 and 5 died");
    CHECK(e.origin_rank() == -1);
    CHECK(e.lost_ranks() == std::vector<int>{4, 5});
  }
}
