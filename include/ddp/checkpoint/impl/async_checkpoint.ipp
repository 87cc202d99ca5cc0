// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/checkpoint/async_checkpoint.hpp>'s non-template functions. That header
// includes this file at its bottom, and nothing else does: in the header-only mode in every unit,
// in the separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cstdio>

DDP_BEGIN_NAMESPACE

DDP_INLINE AsyncSaver::~AsyncSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[ddp] AsyncSaver: the last save, to %s, failed: %s\n",
                 error_path_.c_str(), e.what());
  } catch (...) {
  }
}

DDP_INLINE void AsyncSaver::save(Checkpoint&& ck, std::string path) {
  wait();
  owned_.emplace(std::move(ck));
  keep_ = false;
  start(std::move(path));
}

DDP_INLINE void AsyncSaver::save(const Checkpoint& ck, std::string path) {
  wait();
  keep_ = false;
  {
    const detail::TimelineScope span(detail::Lane::steps, "checkpoint snapshot", "checkpoint");
    ck.serialize_into(bytes_, {});
  }
  owned_.reset();
  start(std::move(path));
}

DDP_INLINE Checkpoint& AsyncSaver::next() {
  wait();
  if (!owned_) owned_.emplace();
  return *owned_;
}

DDP_INLINE void AsyncSaver::save(std::string path) {
  wait();
  if (!owned_) owned_.emplace();
  keep_ = true;
  start(std::move(path));
}

DDP_INLINE void AsyncSaver::wait() {
  if (writer_.joinable()) writer_.join();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

DDP_INLINE void AsyncSaver::start(std::string path) {
  error_path_ = path;
  try {
    writer_ = std::thread([this, p = std::move(path)] { write(p); });
  } catch (const std::system_error& e) {
    detail::fail(Errc::system, "AsyncSaver: no thread to write ", error_path_, ": ", e.what());
  }
}

DDP_INLINE void AsyncSaver::write(const std::string& path) noexcept {
  try {
    const detail::TimelineScope span(detail::Lane::background, "checkpoint write", "checkpoint");
    if (owned_) {
      owned_->serialize_into(bytes_, {});
      if (!keep_) owned_.reset();  // a moved-in state's memory goes back before the slow part
    }
    const std::string tmp = Checkpoint::stage_bytes(path, bytes_);
    Checkpoint::commit(tmp, path);
    detail::remove_abandoned(path);
  } catch (...) {
    if (!keep_) owned_.reset();
    error_ = std::current_exception();
  }
}

DDP_END_NAMESPACE
