// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::Checkpoint: a training run's state as named sections (parameters, the optimizer's state,
/// the sampler's position, the step, seeds), saved atomically and verified when loaded.
///
///     ddp::Checkpoint ck;
///     ck.put_values("w", weights);                       // contiguous trivially copyable values
///     ck.put_object("step", step);                       // anything ddp::codec encodes
///     ck.put_object("sampler", sampler.state(consumed));
///     ddp::save_checkpoint(comm, ck, "run.ckpt");        // collective: rank 0 writes
///     ...
///     if (auto ck = ddp::load_checkpoint(comm, "run.ckpt")) {   // collective: every rank gets it
///       ck->get_values("w", std::span(weights));
///       sampler.restore(ck->get_object<ddp::SamplerState>("sampler"));
///     }
///
/// The file: "DDPCKPT1", the section count, each section's name and length, the sections' bytes,
/// then a 64-bit checksum of everything before it. save() writes a temporary file next to the
/// target (created exclusively under an unpredictable name, never through a link), fsyncs it,
/// renames it over the target and fsyncs the directory, so a crash at any moment leaves the old
/// checkpoint or the new one, never a mixture; a temporary file that a killed save left behind is
/// removed by the next save. Something other than a regular file at the path (a symbolic link, a
/// FIFO, a directory) is refused, never written through or waited on. load() refuses a file that is
/// not a checkpoint, is truncated, or whose checksum differs (Errc::protocol, naming the file and
/// what is wrong). The checksum catches corruption, not tampering: a checkpoint is as trusted as
/// the directory it lives in.

#include "ddp/codec.hpp"
#include "ddp/config.hpp"
#include "ddp/observe/timeline.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/checkpoint/shard_layout.hpp"
#include "ddp/data/partition.hpp"
#include "ddp/detail/files.hpp"
#include "ddp/error.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// SamplerState travels in checkpoints (put_object / get_object).
template <>
struct codec<SamplerState> {
  /// Its five numbers in declaration order; when the epoch changed world size, num_replicas
  /// has its top bit set and the earlier parts follow (a state without them reads as before).
  static void encode(Encoder& e, const SamplerState& s) {
    e.put(s.epoch);
    e.put(s.offset);
    e.put(s.seed);
    e.put(s.dataset_size);
    e.put(s.num_replicas | (s.earlier.empty() ? 0 : more));
    if (!s.earlier.empty()) e.put(s.earlier);
  }
  /// The numbers back.
  static SamplerState decode(Decoder& d) {
    SamplerState s;
    s.epoch = d.get<std::uint64_t>();
    s.offset = d.get<std::uint64_t>();
    s.seed = d.get<std::uint64_t>();
    s.dataset_size = d.get<std::uint64_t>();
    s.num_replicas = d.get<std::uint64_t>();
    if ((s.num_replicas & more) != 0) {
      s.num_replicas &= ~more;
      s.earlier = d.get<std::vector<std::uint64_t>>();
    }
    return s;
  }

 private:
  static constexpr std::uint64_t more = std::uint64_t{1} << 63;
};

namespace detail {
/// The section that records what a put_values() section holds ("ddp.type.<name>").
inline std::string type_section(std::string_view name) { return concat("ddp.type.", name); }
/// A type record read from a file, as a message may quote it: itself when short and printable,
/// else a description (a forged or damaged record must not reach a terminal or a log raw).
inline std::string type_record_text(const std::string& t) {
  const bool plain = !t.empty() && t.size() <= 64 &&
                     std::all_of(t.begin(), t.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
  return plain ? t : concat("an unreadable type record (", t.size(), " bytes)");
}
/// What put_values records of an element type: its DType's name ("float32") for the types
/// collectives carry, else "<n>-byte elements" (trivially copyable types of one's own).
template <class T>
std::string element_type_name() {
  if constexpr (Scalar<T>) {
    return std::string(to_string(dtype_of<T>));
  } else {
    return concat(sizeof(T), "-byte elements");
  }
}
}  // namespace detail

class Checkpoint;
namespace detail {
/// Sections written as they are, a type record ("ddp.type.<name>") too: for ddp's own code that
/// rebuilds a checkpoint from another's sections (resharding, in-memory copies).
struct CheckpointRaw {
  static void put(Checkpoint& ck, std::string_view name, std::span<const std::byte> bytes);
};
}  // namespace detail

/// Named sections of bytes (see the file comment).
class Checkpoint {
  friend struct detail::CheckpointRaw;

 public:
  /// Sets section `name` to `bytes` (replacing one of that name): raw bytes, of no element
  /// type (get() reads them; get_values of any type of the right size too). Names beginning
  /// "ddp.type." are reserved for put_values' type records (Errc::invalid_argument).
  Checkpoint& put(std::string_view name, std::span<const std::byte> bytes);
  /// Section `name` holds the bytes of `values` (a contiguous range of trivially copyable
  /// elements: floats, a std::vector<double>, a std::span), and records their element type
  /// (section "ddp.type.<name>"): get_values reads them back as that type only.
  template <class R>
  requires std::ranges::contiguous_range<R> &&
      std::is_trivially_copyable_v<std::ranges::range_value_t<R>>
          Checkpoint& put_values(std::string_view name, const R& values) {
    put(name, std::as_bytes(std::span(std::ranges::data(values), std::ranges::size(values))));
    const std::string type = detail::element_type_name<std::ranges::range_value_t<R>>();
    put_section(detail::type_section(name), type);
    return *this;
  }
  /// Section `name` holds `value` encoded by ddp::codec (numbers, strings, vectors, optionals,
  /// SamplerState, your types with a codec).
  template <Encodable T>
  Checkpoint& put_object(std::string_view name, const T& value) {
    const std::string bytes = detail::encode_object(value);
    return put(name, std::as_bytes(std::span(bytes.data(), bytes.size())));
  }

  /// Section `name` holds `values`, this rank's shard of some arrays laid out as `layout` says
  /// (its pieces in the order of the values; ShardedAverager::layout() for state kept per element
  /// of its shard, such as an optimizer's moments), and records the layout beside it (in section
  /// "ddp.sharded.<name>"). get_values reads it back; loaded on another world size by
  /// load_sharded_checkpoint, it holds the values of the new rank's pieces instead.
  /// Errc::invalid_argument when the layout holds another number of values or lies outside its
  /// arrays.
  template <class R>
  requires std::ranges::contiguous_range<R> &&
      std::is_trivially_copyable_v<std::ranges::range_value_t<R>>
          Checkpoint& put_sharded(std::string_view name, const R& values,
                                  const ShardLayout& layout) {
    check_name(name);
    detail::check_layout(layout, detail::concat("Checkpoint::put_sharded(\"", name, "\")"));
    if (layout.elements() != std::ranges::size(values))
      detail::fail(Errc::invalid_argument, "Checkpoint::put_sharded(\"", name,
                   "\"): the layout has ", layout.elements(), " elements but ",
                   std::ranges::size(values), " values were given");
    put_values(name, values);
    return put_object(detail::layout_section(name),
                      detail::layout_words(sizeof(std::ranges::range_value_t<R>), layout));
  }
  /// The layout of sharded section `name` (put_sharded), or std::nullopt for a section that is
  /// not sharded.
  [[nodiscard]] std::optional<ShardLayout> sharded_layout(std::string_view name) const;

  /// Whether there is a section named `name`.
  [[nodiscard]] bool contains(std::string_view name) const noexcept;
  /// The sections' names, in the order they were first put.
  [[nodiscard]] std::vector<std::string> names() const;
  /// Section `name`'s bytes; Errc::invalid_argument naming it (and the sections there are) when
  /// there is none.
  [[nodiscard]] std::span<const std::byte> get(std::string_view name) const;
  /// Copies section `name` into `out`, which must have exactly its size; a section put_values
  /// wrote is read as the element type it was put as only (Errc::invalid_argument naming both
  /// types and counts otherwise; get() gives the bytes of any section).
  template <class T>
    requires std::is_trivially_copyable_v<T> &&
        (!std::is_const_v<T>)void get_values(std::string_view name, std::span<T> out) const {
      const std::string& b = section(name);
      const std::string* type = find_section(detail::type_section(name));
      const std::string asked = detail::element_type_name<T>();
      if (type != nullptr && *type != asked)
        detail::fail(Errc::invalid_argument, "Checkpoint: section \"", name, "\" holds ",
                     detail::type_record_text(*type), " (", b.size(), " bytes), but ", out.size(),
                     " ", asked,
                     " were asked for: read it as the type it was put as (get() gives its bytes)");
      if (b.size() != out.size_bytes()) {
        if (type != nullptr && b.size() % sizeof(T) != 0)
          detail::fail(Errc::protocol, "Checkpoint: section \"", name, "\" holds ", b.size(),
                       " bytes, not a whole number of ", asked, ": the checkpoint is damaged");
        if (type != nullptr)
          detail::fail(Errc::invalid_argument, "Checkpoint: section \"", name, "\" holds ",
                       b.size() / sizeof(T), " ", asked, ", but ", out.size(),
                       " were asked for: the model changed since it was saved");
        detail::fail(Errc::invalid_argument, "Checkpoint: section \"", name, "\" holds ", b.size(),
                     " bytes, but ", out.size(), " values of ", sizeof(T), " bytes (",
                     out.size_bytes(),
                     ") were asked for: the model or its element type changed since it was saved");
      }
      if (!b.empty()) std::memcpy(out.data(), b.data(), b.size());
    }
    /// Section `name` decoded as T (it must have been put_object'ed as a T).
    template <Encodable T>
    [[nodiscard]] T get_object(std::string_view name) const {
      const std::string& b = section(name);
      try {
        return detail::decode_object<T>(b.data(), b.size());
      } catch (const Error& e) {
        detail::fail(Errc::invalid_argument, "Checkpoint: section \"", name,
                     "\" does not hold the type asked for: ", e.what());
      }
    }

    /// The checkpoint as the bytes of its file.
    [[nodiscard]] std::string serialize() const { return serialize_with({}); }
    /// A section given by name and bytes, for serialize_with().
    using Section = std::pair<std::string_view, std::string_view>;
    /// The bytes of the file this checkpoint would be with the `extra` sections added (sections
    /// of those names already there are left out), without copying the checkpoint.
    [[nodiscard]] std::string serialize_with(std::span<const Section> extra) const;
    /// serialize_with() into `out` (its memory reused: no allocation when it is large enough).
    void serialize_into(std::string& out, std::span<const Section> extra) const;
    /// Parses and verifies the bytes of a checkpoint file; Errc::protocol saying what is wrong,
    /// with `what` (e.g. the path) in the message.
    [[nodiscard]] static Checkpoint parse(std::string_view bytes, std::string_view what);

    /// Writes the checkpoint to `path` atomically (see the file comment); Errc::system naming the
    /// path and the reason (a full disk, a missing directory, permissions) on failure, leaving any
    /// earlier file at `path` as it was. Errc::invalid_argument when something other than a
    /// regular file is at `path` (a symbolic link, a FIFO, a directory): it is neither replaced
    /// nor written through. Temporary files that earlier saves to `path` left behind when their
    /// process was killed are removed.
    void save(const std::string& path) const;

    /// The first half of save(): writes the checkpoint to a temporary file next to `path` and
    /// flushes it to disk; returns that file's name (for commit() or discard()).
    [[nodiscard]] std::string stage(const std::string& path) const {
      return stage_bytes(path, serialize());
    }
    /// stage() of given file bytes (from serialize() or serialize_with()). The temporary file is
    /// created exclusively under an unpredictable name ("<path>.tmp.<pid>.<random>"), never
    /// through a link.
    [[nodiscard]] static std::string stage_bytes(const std::string& path, const std::string& bytes);

    /// The second half of save(): renames the staged file `tmp` over `path` and flushes the
    /// directory, so the new checkpoint replaces the old one in one step.
    static void commit(const std::string& tmp, const std::string& path);

    /// Removes a staged file that will not be committed.
    static void discard(const std::string& tmp) noexcept { ::unlink(tmp.c_str()); }

    /// Reads and verifies `path`; std::nullopt when there is no file there (a run that starts
    /// afresh); Errc::protocol for a file that is not a valid checkpoint, Errc::system when it
    /// cannot be read, Errc::invalid_argument when `path` is not a regular file (a FIFO, a
    /// directory, a device: refused without waiting on it; a symbolic link to a regular file is
    /// followed).
    [[nodiscard]] static std::optional<Checkpoint> load(const std::string& path);

   private:
    static constexpr char magic[8] = {'D', 'D', 'P', 'C', 'K', 'P', 'T', '1'};

    const std::string& section(std::string_view name) const;
    /// Section `name`, or nullptr.
    [[nodiscard]] const std::string* find_section(std::string_view name) const noexcept;
    /// put() of a string's bytes.
    void put_section(std::string_view name, std::string_view bytes) {
      put_raw(name, std::as_bytes(std::span(bytes.data(), bytes.size())));
    }
    /// put() without dropping the section's type record.
    void put_raw(std::string_view name, std::span<const std::byte> bytes);
    /// Errc::invalid_argument when something other than a regular file is at `path`.
    static void check_target(const std::string& path) {
      if (const char* kind = detail::non_regular(path)) refuse_target(path, kind);
    }
    [[noreturn]] static void refuse_target(const std::string& path, const char* kind);
    static void check_name(std::string_view name);
    template <class... A>
    [[noreturn]] static void io_fail(const A&... what) {
      const int err = errno;
      detail::fail(Errc::system, "Checkpoint: ", what..., ": ", std::strerror(err));
    }
    static void put_u64(std::string& out, std::uint64_t v);
    static std::uint64_t get_u64(std::string_view in, std::size_t at);
    /// A 64-bit checksum (multiply-xorshift over 8-byte words, then the tail and the length):
    /// several GB/s, and any change of a byte or of the length changes it with high probability.
    static std::uint64_t checksum(const char* data, std::size_t n);

    std::vector<std::pair<std::string, std::string>> sections_;
};

namespace detail {
/// "<errc number> <message>" of an Error, to send to the other ranks.
inline std::string error_text(const Error& e) {
  return concat(static_cast<int>(e.code()), " ", e.what());
}
/// Fails on this rank with the error `text` (error_text) that rank `from` relayed: its code, and
/// "rank <this>: <what>: rank <from> <how>: <its message>".
template <class Comm>
[[noreturn]] void fail_relayed(Comm& comm, const std::string& text, const char* what,
                               std::size_t from, const char* how) {
  const std::size_t space = text.find(' ');
  fail(static_cast<Errc>(std::stoi(text.substr(0, space))), "rank ", comm.rank(), ": ", what,
       ": rank ", from, " ", how, ": ", text.substr(space + 1));
}
/// Fails with the first rank's error in `errors` (gathered from every rank), if there is one.
template <class Comm>
void fail_with_first(Comm& comm, const std::vector<std::string>& errors, const char* what) {
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) fail_relayed(comm, errors[r], what, r, "failed");
}

/// A load from `path` whose directory does not exist is a wrong path, not a fresh start:
/// Errc::invalid_argument naming it (the save at the end of the first epoch would fail anyway).
DDP_INLINE void check_directory(const std::string& path, const char* what);
}  // namespace detail

/// Collective: rank `root` saves `ck` to `path` (Checkpoint::save); every rank returns once the
/// file is complete, or fails with root's error.
template <class Comm>
void save_checkpoint(Comm& comm, const Checkpoint& ck, const std::string& path, int root = 0) {
  std::string error;  // "<errc number> <message>", empty when it worked
  if (comm.rank() == root) {
    try {
      ck.save(path);
    } catch (const Error& e) {
      error = detail::error_text(e);
    }
  }
  comm.broadcast_object(error, root);
  if (!error.empty())
    detail::fail_relayed(comm, error, "save_checkpoint", static_cast<std::size_t>(root),
                         "could not save");
}

/// Collective: rank `root` loads and verifies `path`, and every rank gets the same checkpoint
/// (broadcast); std::nullopt on every rank when there is no file (a run that starts afresh).
/// Fails on every rank with root's error when the file is not a valid checkpoint.
template <class Comm>
[[nodiscard]] std::optional<Checkpoint> load_checkpoint(Comm& comm, const std::string& path,
                                                        int root = 0) {
  std::string state;  // "ok", "none", or "<errc number> <message>"
  std::string bytes;
  if (comm.rank() == root) {
    try {
      detail::check_directory(path, "Checkpoint");
      const auto ck = Checkpoint::load(path);
      state = ck ? "ok" : "none";
      if (ck) bytes = ck->serialize();
    } catch (const Error& e) {
      state = detail::error_text(e);
    }
  }
  comm.broadcast_object(state, root);
  if (state == "none") return std::nullopt;
  if (state != "ok")
    detail::fail_relayed(comm, state, "load_checkpoint", static_cast<std::size_t>(root),
                         "could not load");
  comm.broadcast_object(bytes, root);
  return Checkpoint::parse(bytes, path);
}

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/checkpoint/impl/checkpoint.ipp"
#endif
