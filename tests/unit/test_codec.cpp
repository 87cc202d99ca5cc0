// The object codec: round trips, and hostile input refused with bounded allocation.
#include <ddp/codec.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace user {
struct Sample {
  int id = 0;
  std::string label;
  std::vector<float> features;
  friend bool operator==(const Sample&, const Sample&) = default;
};
}  // namespace user

template <>
struct ddp::codec<user::Sample> {
  static void encode(ddp::Encoder& e, const user::Sample& s) {
    e.put(s.id);
    e.put(s.label);
    e.put(s.features);
  }
  static user::Sample decode(ddp::Decoder& d) {
    user::Sample s;
    s.id = d.get<int>();
    s.label = d.get<std::string>();
    s.features = d.get<std::vector<float>>();
    return s;
  }
};

namespace {

template <class T>
T round_trip(const T& v) {
  const std::string bytes = ddp::detail::encode_object(v);
  return ddp::detail::decode_object<T>(bytes.data(), bytes.size());
}

template <class T>
std::string decode_error(const std::string& bytes) {
  try {
    (void)ddp::detail::decode_object<T>(bytes.data(), bytes.size());
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
    return e.what();
  }
  return "";
}

std::string with_tag_of(std::uint64_t tag, const std::string& body) {
  std::string s(sizeof tag, '\0');
  std::memcpy(s.data(), &tag, sizeof tag);
  return s + body;
}

std::string u64(std::uint64_t v) {
  std::string s(8, '\0');
  std::memcpy(s.data(), &v, 8);
  return s;
}

}  // namespace

TEST_CASE("codec: every type has its own tag") {
  CHECK(ddp::detail::type_tag<int>() != ddp::detail::type_tag<long>());
  CHECK(ddp::detail::type_tag<std::vector<int>>() !=
        ddp::detail::type_tag<std::vector<std::string>>());
  CHECK(ddp::detail::type_tag<user::Sample>() != ddp::detail::type_tag<std::string>());
  CHECK(ddp::detail::type_tag<int>() == ddp::detail::type_tag<int>());
}

TEST_CASE("codec: round trips of built-in and user types") {
  static_assert(ddp::Encodable<int> && ddp::Encodable<std::string> &&
                ddp::Encodable<std::vector<std::string>>);
  static_assert(ddp::Encodable<user::Sample> && ddp::Encodable<std::optional<user::Sample>>);
  static_assert(!ddp::Encodable<std::map<int, int>>);  // no codec: refused at compile time
  CHECK(round_trip(42) == 42);
  CHECK(round_trip(std::string("héllo\0x", 8)) == std::string("héllo\0x", 8));
  CHECK(round_trip(std::vector<double>{1.5, -2.0}) == std::vector<double>{1.5, -2.0});
  const std::vector<std::vector<std::string>> nested{{"a", "bc"}, {}, {"def"}};
  CHECK(round_trip(nested) == nested);
  CHECK(round_trip(std::optional<std::string>{}) == std::nullopt);
  CHECK(round_trip(std::pair<std::string, int>{"x", 3}) == std::pair<std::string, int>{"x", 3});
  const user::Sample s{7, "shirt", {0.25f, 0.5f}};
  CHECK(round_trip(s) == s);
  CHECK(round_trip(std::vector<user::Sample>{s, s}).size() == 2);
}

TEST_CASE("codec: hostile input is refused before allocating") {
  const auto tag = ddp::detail::type_tag<std::vector<std::string>>();
  // Truncated: every prefix of a valid message.
  const std::string good = ddp::detail::encode_object(std::vector<std::string>{"alpha", "beta"});
  for (std::size_t n = 0; n < good.size(); ++n) {
    CAPTURE(n);
    CHECK(decode_error<std::vector<std::string>>(good.substr(0, n)).find("object decode") !=
          std::string::npos);
  }
  // Counts the input cannot hold: 2^63 and 2^64-1 strings in 8 bytes.
  CHECK(decode_error<std::vector<std::string>>(with_tag_of(tag, u64(1ull << 63)))
            .find("cannot fit") != std::string::npos);
  CHECK(decode_error<std::vector<std::string>>(with_tag_of(tag, u64(~0ull))).find("cannot fit") !=
        std::string::npos);
  CHECK(decode_error<std::string>(
            with_tag_of(ddp::detail::type_tag<std::string>(), u64(1ull << 40) + "abc"))
            .find("cannot fit") != std::string::npos);
  // A vector of floats claiming more elements than bytes (4 bytes each).
  CHECK(decode_error<std::vector<float>>(
            with_tag_of(ddp::detail::type_tag<std::vector<float>>(), u64(3) + "12345678"))
            .find("cannot fit") != std::string::npos);
  // Wrong type tag.
  CHECK(decode_error<std::vector<int>>(good).find("different type") != std::string::npos);
  // Trailing garbage.
  CHECK(decode_error<std::vector<std::string>>(good + "x").find("trailing") != std::string::npos);
  // Bad optional flag.
  CHECK(decode_error<std::optional<int>>(
            with_tag_of(ddp::detail::type_tag<std::optional<int>>(), std::string(1, '\x07')))
            .find("optional flag") != std::string::npos);
}

namespace user {
// A recursive type: its codec recurses, so hostile input could nest without end.
struct Tree {
  std::vector<Tree> children;
};
}  // namespace user

template <>
struct ddp::codec<user::Tree> {
  static void encode(ddp::Encoder& e, const user::Tree& t) { e.put(t.children); }
  static user::Tree decode(ddp::Decoder& d) { return {d.get<std::vector<user::Tree>>()}; }
};

TEST_CASE("codec: nesting is bounded") {
  user::Tree shallow;
  shallow.children.resize(2);
  shallow.children[0].children.resize(3);
  CHECK(round_trip(shallow).children.size() == 2);
  // A chain 100 levels deep encodes, but decoding stops at the depth limit.
  user::Tree deep;
  user::Tree* node = &deep;
  for (int i = 0; i < 100; ++i) {
    node->children.resize(1);
    node = &node->children[0];
  }
  const std::string bytes = ddp::detail::encode_object(deep);
  CHECK(decode_error<user::Tree>(bytes).find("nesting deeper than 64") != std::string::npos);
  // bool is checked too.
  CHECK(decode_error<bool>(with_tag_of(ddp::detail::type_tag<bool>(), std::string(1, '\x02')))
            .find("bad bool") != std::string::npos);
}
