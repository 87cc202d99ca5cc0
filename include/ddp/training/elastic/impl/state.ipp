// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/training/elastic/state.hpp>'s non-template functions. That header includes
// this file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE

DDP_INLINE TrainingState& TrainingState::track_sampler(std::string name,
                                                       DistributedSampler& sampler) {
  Piece piece;
  piece.name = new_name(std::move(name));
  piece.kind = 2;
  piece.describe = [&sampler] { return static_cast<std::uint64_t>(sampler.dataset_size()); };
  piece.save = [&sampler] { return detail::encode_object(sampler.state()); };
  piece.load = [&sampler](const std::string& bytes) {
    const auto s = detail::decode_object<SamplerState>(bytes.data(), bytes.size());
    sampler = DistributedSampler(static_cast<std::size_t>(s.dataset_size),
                                 static_cast<int>(s.num_replicas), 0, sampler.options());
    sampler.restore(s);
  };
  piece.regroup = [&sampler](int size, int rank) {
    const SamplerState s = sampler.state();
    if (s.num_replicas != static_cast<std::uint64_t>(size)) {
      sampler.repartition(size, rank);
    } else {  // as many ranks: each takes its positions from the same place on
      sampler = DistributedSampler(sampler.dataset_size(), size, rank, sampler.options());
      sampler.restore(s);
    }
  };
  pieces_.push_back(std::move(piece));
  return *this;
}

DDP_INLINE std::string TrainingState::ticket() const {
  std::string t;
  for (const Piece& p : pieces_) {
    const char* kind = p.kind == 0   ? " tensor of bytes "
                       : p.kind == 1 ? " object "
                                     : " sampler of ";
    t += detail::concat(t.empty() ? "" : ";", p.name, kind,
                        p.where ? p.where().bytes : p.describe());
  }
  return t;
}

DDP_INLINE std::size_t TrainingState::bytes() const noexcept {
  std::size_t n = 0;
  for (const Piece& p : pieces_) n += p.saved.size();
  return n;
}

DDP_INLINE std::string TrainingState::new_name(std::string name) const {
  for (const Piece& p : pieces_)
    if (p.name == name)
      detail::fail(Errc::invalid_argument, "TrainingState: \"", name, "\" is tracked twice");
  return name;
}

DDP_INLINE void TrainingState::add(std::string name, std::function<Raw()> where) {
  Piece piece;
  piece.name = new_name(std::move(name));
  piece.where = std::move(where);
  pieces_.push_back(std::move(piece));
}

DDP_INLINE void TrainingState::snapshot() {
  for (Piece& p : pieces_) {
    if (p.save) {
      p.saved = p.save();
      continue;
    }
    const Raw r = p.where();
    p.saved.resize(r.bytes);
    detail::copy_bytes(p.saved.data(), r.data, r.bytes, r.cuda, r.stream);
    detail::sync_stream(r.cuda, r.stream);
  }
}

DDP_END_NAMESPACE
