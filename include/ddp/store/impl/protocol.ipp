// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/store/protocol.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail::store_proto {

DDP_INLINE IoResult send_frame(int fd, std::string_view payload, Deadline d) {
  std::string buf;
  ByteWriter w(buf);
  w.put(static_cast<std::uint32_t>(payload.size()));
  buf.append(payload);
  return send_all(fd, buf.data(), buf.size(), d);
}

DDP_INLINE IoResult recv_frame(int fd, std::string& out, std::size_t limit, Deadline d,
                               std::string_view what) {
  std::uint8_t len_bytes[4];
  if (auto r = recv_all(fd, len_bytes, 4, d); r != IoResult::ok) return r;
  ByteReader lr(len_bytes, 4, what);
  const auto len = lr.get<std::uint32_t>();
  if (len > limit)
    detail::fail(Errc::protocol, what, ": frame of ", len, " bytes exceeds the limit of ", limit);
  out.resize(len);
  return recv_all(fd, out.data(), len, d);
}
}  // namespace detail::store_proto
DDP_END_NAMESPACE

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string encode_stop(const Error& e) {
  std::string v;
  ByteWriter w(v);
  w.put(static_cast<std::int32_t>(e.code()));
  const std::string_view whole = e.what();
  w.str(whole);
  w.put(static_cast<std::int32_t>(e.origin_rank()));
  w.put(static_cast<std::uint32_t>(whole.size() - e.origin_message().size()));
  w.put(static_cast<std::uint32_t>(e.lost_ranks().size()));
  for (const int r : e.lost_ranks()) w.put(static_cast<std::int32_t>(r));
  return v;
}

DDP_INLINE std::optional<Error> decode_stop(std::string_view value) {
  if (value.size() < 8) return std::nullopt;
  try {
    ByteReader r(value, "stop value");
    const auto code = r.get<std::int32_t>();
    if (code < 1 || code > static_cast<std::int32_t>(Errc::unsupported)) return std::nullopt;
    const std::string message = r.str(value.size());
    if (r.left() == 0) return Error(static_cast<Errc>(code), message);
    const auto origin = r.get<std::int32_t>();
    const auto at = std::min<std::size_t>(r.get<std::uint32_t>(), message.size());
    const auto n = r.get<std::uint32_t>();
    if (n > r.left() / 4) return std::nullopt;
    std::vector<int> lost(n);
    for (int& x : lost) x = r.get<std::int32_t>();
    r.expect_end();
    return Error(static_cast<Errc>(code), std::string_view(message).substr(0, at), origin,
                 std::string_view(message).substr(at), std::move(lost));
  } catch (const Error&) {  // not a stop value
    return std::nullopt;
  }
}

}  // namespace detail
DDP_END_NAMESPACE
