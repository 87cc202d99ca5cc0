// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/training/averaging/comm_hooks.hpp>'s non-template functions. That header
// includes this file at its bottom, and nothing else does: in the header-only mode in every unit,
// in the separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::exception_ptr hook_error(int rank, const char* who, std::size_t k,
                                         std::span<const BucketPiece> pieces) {
  Errc code = Errc::invalid_argument;
  std::string what = "an exception that is not a std::exception", params;
  const char* hint = "; a hook returns the Work of the collectives it started, on every rank";
  try {
    throw;
  } catch (const Error& e) {
    code = e.code(), what = e.what(), hint = "";
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
  }
  for (const BucketPiece& p : pieces)
    params += (params.empty() ? "" : ", ") + std::to_string(p.param);
  return std::make_exception_ptr(
      Error(code, concat("rank ", rank, ": ", who, ": the comm hook failed on bucket ", k,
                         " (parameters ", params, "): ", what, "; the step was dropped", hint)));
}

}  // namespace detail
DDP_END_NAMESPACE
