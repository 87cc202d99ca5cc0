// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/detail/json.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cstdio>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string base64_encode(std::string_view bytes) {
  static constexpr char table[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (std::size_t i = 0; i < bytes.size(); i += 3) {
    const std::size_t n = std::min<std::size_t>(3, bytes.size() - i);
    std::uint32_t v = 0;
    for (std::size_t k = 0; k < 3; ++k)
      v = v << 8 | (k < n ? static_cast<unsigned char>(bytes[i + k]) : 0u);
    for (std::size_t k = 0; k < 4; ++k)
      out.push_back(k <= n ? table[(v >> (18 - 6 * k)) & 63u] : '=');
  }
  return out;
}

DDP_INLINE std::string base64_decode(std::string_view text) {
  const auto value = [&](char c) -> std::uint32_t {
    if (c >= 'A' && c <= 'Z') return static_cast<std::uint32_t>(c - 'A');
    if (c >= 'a' && c <= 'z') return static_cast<std::uint32_t>(c - 'a' + 26);
    if (c >= '0' && c <= '9') return static_cast<std::uint32_t>(c - '0' + 52);
    if (c == '+' || c == '-') return 62;
    if (c == '/' || c == '_') return 63;
    fail(Errc::protocol, "not base64: a '", c, "' in \"", text.substr(0, 40), "\"");
  };
  while (!text.empty() && text.back() == '=') text.remove_suffix(1);
  if (text.size() % 4 == 1) fail(Errc::protocol, "not base64: ", text.size(), " characters");
  std::string out;
  out.reserve(text.size() * 3 / 4);
  std::uint32_t v = 0;
  int bits = 0;
  for (const char c : text) {
    v = v << 6 | value(c);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((v >> bits) & 0xffu));
    }
  }
  return out;
}

DDP_INLINE const Json* Json::find(std::string_view key) const {
  if (type != Type::object) return nullptr;
  for (std::size_t i = 0; i < names.size(); ++i)
    if (names[i] == key) return &items[i];
  return nullptr;
}

DDP_INLINE std::string Json::get(std::string_view key) const {
  const Json* v = find(key);
  return v != nullptr && (v->type == Type::string || v->type == Type::number) ? v->text
                                                                              : std::string();
}

DDP_INLINE std::int64_t Json::integer(std::string_view key, std::int64_t otherwise) const {
  const std::string t = get(key);
  if (t.empty()) return otherwise;
  std::int64_t v = 0;
  bool negative = false;
  std::size_t i = 0;
  if (t[0] == '-') {
    negative = true;
    i = 1;
  }
  for (; i < t.size(); ++i) {
    if (t[i] < '0' || t[i] > '9') fail(Errc::protocol, "not an integer: \"", t, "\"");
    v = v * 10 + (t[i] - '0');
  }
  return negative ? -v : v;
}

DDP_INLINE Json parse_json(std::string_view s, int max_depth) {
  std::size_t at = 0;
  const auto bad = [&](std::string_view why) -> void {
    fail(Errc::protocol, "malformed JSON (", why, " at byte ", at, "): \"", s.substr(0, 200), "\"");
  };
  const auto skip = [&] {
    while (at < s.size() && (s[at] == ' ' || s[at] == '\t' || s[at] == '\n' || s[at] == '\r')) ++at;
  };
  const auto string = [&]() -> std::string {
    std::string out;
    ++at;  // the quote
    while (at < s.size() && s[at] != '"') {
      char c = s[at++];
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (at >= s.size()) break;
      c = s[at++];
      switch (c) {
        case 'n': out.push_back('\n'); break;
        case 't': out.push_back('\t'); break;
        case 'r': out.push_back('\r'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'u': {
          if (at + 4 > s.size()) bad("short \\u escape");
          std::uint32_t cp = 0;
          for (int k = 0; k < 4; ++k) {
            const char h = s[at++];
            cp = cp << 4 | static_cast<std::uint32_t>(h >= '0' && h <= '9'   ? h - '0'
                                                      : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                                      : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                                             : 99);
          }
          if (cp > 0xffff) bad("bad \\u escape");
          if (cp < 0x80) {
            out.push_back(static_cast<char>(cp));
          } else if (cp < 0x800) {
            out.push_back(static_cast<char>(0xc0 | (cp >> 6)));
            out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
          } else {
            out.push_back(static_cast<char>(0xe0 | (cp >> 12)));
            out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
            out.push_back(static_cast<char>(0x80 | (cp & 0x3f)));
          }
          break;
        }
        default: out.push_back(c); break;  // \" \\ \/
      }
    }
    if (at >= s.size()) bad("unterminated string");
    ++at;
    return out;
  };
  const auto value = [&](const auto& self, int depth) -> Json {
    if (depth > max_depth) bad("nested too deep");
    skip();
    Json v;
    if (at >= s.size()) bad("unexpected end");
    const char c = s[at];
    if (c == '{') {
      v.type = Json::Type::object;
      ++at;
      skip();
      if (at < s.size() && s[at] == '}') return ++at, v;
      for (;;) {
        skip();
        if (at >= s.size() || s[at] != '"') bad("expected a key");
        std::string key = string();
        skip();
        if (at >= s.size() || s[at] != ':') bad("expected ':'");
        ++at;
        v.names.push_back(std::move(key));
        v.items.push_back(self(self, depth + 1));
        skip();
        if (at < s.size() && s[at] == ',') {
          ++at;
          continue;
        }
        if (at < s.size() && s[at] == '}') return ++at, v;
        bad("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.type = Json::Type::array;
      ++at;
      skip();
      if (at < s.size() && s[at] == ']') return ++at, v;
      for (;;) {
        v.items.push_back(self(self, depth + 1));
        skip();
        if (at < s.size() && s[at] == ',') {
          ++at;
          continue;
        }
        if (at < s.size() && s[at] == ']') return ++at, v;
        bad("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v.type = Json::Type::string;
      v.text = string();
      return v;
    }
    const auto word = [&](std::string_view w) { return s.substr(at, w.size()) == w; };
    if (word("true") || word("false")) {
      v.type = Json::Type::boolean;
      v.boolean = c == 't';
      at += v.boolean ? 4 : 5;
      return v;
    }
    if (word("null")) return at += 4, v;
    const std::size_t start = at;
    while (at < s.size() && ((s[at] >= '0' && s[at] <= '9') || s[at] == '-' || s[at] == '+' ||
                             s[at] == '.' || s[at] == 'e' || s[at] == 'E'))
      ++at;
    if (at == start) bad("unexpected character");
    v.type = Json::Type::number;
    v.text = std::string(s.substr(start, at - start));
    return v;
  };
  Json out = value(value, 0);
  skip();
  if (at != s.size()) bad("trailing bytes");
  return out;
}

DDP_INLINE std::string json_quoted(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char u[8];
          std::snprintf(u, sizeof u, "\\u%04x", static_cast<unsigned>(c));
          out += u;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

}  // namespace detail
DDP_END_NAMESPACE
