// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/transport.hpp>'s non-template functions. That header includes
// this file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <bit>
#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE Transport::Transport(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_(timeout) {}

DDP_INLINE int Transport::global(int j) const {
  return global_ranks.empty() ? j : global_ranks[static_cast<std::size_t>(j)];
}

DDP_INLINE std::string Transport::describe(const Fingerprint* fp, const char* what) const {
  if (fp != nullptr) return to_string(*fp);
  if (what != nullptr) return what;
  if (has_current) return to_string(current);
  return "operation";
}

DDP_INLINE std::size_t Transport::single_copy_from() const noexcept { return ~std::size_t{0}; }

DDP_INLINE void Transport::copy_from(int j, std::uint64_t /*addr*/, std::byte* /*dst*/,
                                     std::size_t /*len*/, const Fingerprint* fp) {
  fail(Errc::unsupported, "rank ", global(rank_), ": ", describe(fp, nullptr),
       ": internal error: single copy from rank ", global(j), " on the ", name(), " transport");
}

DDP_INLINE std::string Transport::mismatch_message(const Fingerprint& mine, int peer,
                                                   const Fingerprint& theirs) const {
  if (static_cast<std::uint8_t>(theirs.coll) == P2PHeader::p2p) {
    const auto h = std::bit_cast<P2PHeader>(theirs);
    return concat("rank ", global(rank_), ": ", to_string(mine), ": rank ", global(peer),
                  " sent this rank a message that no recv took (send(tag ", h.tag, ", ",
                  to_string(h.dtype), ", count=", h.count, ") #", h.seq,
                  ") before this collective; every send needs its recv on the peer before "
                  "the next collective");
  }
  const std::string what = theirs.coll == static_cast<Coll>(0)
                               ? std::string("was in a later round of another collective")
                               : concat("called ", to_string(theirs));
  return concat(
      "rank ", global(rank_), ": ", to_string(mine.coll),
      ": mismatched collectives: this rank called ", to_string(mine), " but rank ", global(peer),
      " ", what,
      "; every rank must call the same collectives, in the same order, with the same counts, "
      "dtypes, ops and roots");
}

DDP_INLINE std::string Transport::recv_description(const Buf& buf, int peer, int tag) {
  return concat("recv(from rank ", peer, ", tag ", tag, ", ", to_string(buf.dtype),
                ", count=", buf.count, ")");
}

DDP_INLINE std::string Transport::p2p_mismatch(const Buf& buf, int peer, int tag, std::uint64_t seq,
                                               const P2PHeader& h) const {
  if (h.kind != P2PHeader::p2p) {
    const auto theirs = std::bit_cast<Fingerprint>(h);
    return concat("rank ", rank_, ": ", recv_description(buf, peer, tag), " #", seq,
                  " got no message from rank ", peer, " but ",
                  theirs.coll == static_cast<Coll>(0) || !verify_fingerprints
                      ? std::string("other data (a collective's)")
                      : concat("the start of a collective, ", to_string(theirs)),
                  ": that rank called a collective where this rank receives; every recv needs "
                  "its send on the peer before the next collective");
  }
  if (h.seq == seq && h.tag == tag && h.dtype == buf.dtype && h.count == buf.count) return {};
  return concat("rank ", rank_, ": ", recv_description(buf, peer, tag), " #", seq, " got send(tag ",
                h.tag, ", ", to_string(h.dtype), ", count=", h.count, ") #", h.seq,
                "; sends and receives between a pair are matched in order and must agree");
}

DDP_INLINE void Transport::fail_if_left(const std::vector<int>& ranks,
                                        std::chrono::milliseconds grace, const Fingerprint* fp,
                                        const char* what) const {
  if (!why_left) return;
  std::vector<int> globals;
  for (int j : ranks) globals.push_back(global(j));
  if (const auto left = why_left(globals, grace)) {
    if (left->finished) {
      fail(Errc::peer_lost, "rank ", global(rank_), ": ", describe(fp, what), ": rank ", left->rank,
           " finished (it destroyed its communicator after ", left->operations,
           " operations, without a failure) while this rank waited for it: the ranks ran "
           "different numbers of collectives (steps). For uneven inputs see ddp::Join; "
           "otherwise make every rank call the same collectives");
    }
    fail_reported(*left, fp, what);
  }
}

DDP_INLINE void Transport::fail_reported(const Left& left, const Fingerprint* fp,
                                         const char* what) const {
  const bool relayed = left.origin >= 0;
  const int from = relayed ? left.origin : left.rank;
  DDP_THROW(Error(left.code,
                  concat("rank ", global(rank_), ": ", describe(fp, what), ": failed because rank ",
                         from, " reported: "),
                  from, relayed ? left.origin_message : left.message, left.lost));
}

DDP_INLINE void Transport::check_local_abort(const Fingerprint* fp) const {
  if (const int code = local_abort_code_.load(); code != 0) {
    fail(static_cast<Errc>(code), "rank ", global(rank_), ": ", describe(fp, nullptr),
         ": the communicator was aborted on this rank; create a new communicator to continue");
  }
}

DDP_INLINE SelfTransport::SelfTransport(std::chrono::milliseconds timeout)
    : Transport(0, 1, timeout) {}

DDP_INLINE std::size_t SelfTransport::max_offer() const noexcept { return std::size_t{1} << 40; }

DDP_INLINE std::size_t SelfTransport::small_bytes() const noexcept { return std::size_t{1} << 40; }

DDP_INLINE std::span<const std::byte* const> SelfTransport::round(std::span<const Piece> offer,
                                                                  Want want, const Fingerprint*) {
  ptr_ = locate(offer, want(0, 0));
  return {&ptr_, 1};
}

DDP_INLINE const std::byte* SelfTransport::locate(std::span<const Piece> offer, Range r) {
  if (r.len == 0) return nullptr;
  std::size_t base = 0;
  for (const auto& p : offer) {
    if (r.off >= base && r.off + r.len <= base + p.len) return p.data + (r.off - base);
    base += p.len;
  }
  fail(Errc::invalid_argument, "internal error: a wanted range crosses offer pieces");
}

}  // namespace detail
DDP_END_NAMESPACE
