// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/environment.hpp>'s non-template functions. That header includes this file at
// its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <charconv>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::optional<int> slurm_tasks_on_node(std::string_view layout, int node) {
  int index = 0;
  while (!layout.empty()) {
    const std::size_t comma = layout.find(',');
    const std::string_view item = layout.substr(0, comma);
    layout = comma == std::string_view::npos ? std::string_view{} : layout.substr(comma + 1);
    int tasks = 0, repeat = 1;
    auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), tasks);
    if (ec != std::errc{} || tasks < 1) return std::nullopt;
    std::string_view rest(end, static_cast<std::size_t>(item.data() + item.size() - end));
    if (!rest.empty()) {  // "(xM)"
      if (rest.size() < 4 || rest.substr(0, 2) != "(x" || rest.back() != ')') return std::nullopt;
      const auto [e2, ec2] =
          std::from_chars(rest.data() + 2, rest.data() + rest.size() - 1, repeat);
      if (ec2 != std::errc{} || e2 != rest.data() + rest.size() - 1 || repeat < 1)
        return std::nullopt;
    }
    if (node < index + repeat) return tasks;
    index += repeat;
  }
  return std::nullopt;
}

DDP_INLINE std::string first_slurm_host(std::string_view list) {
  const auto bracket = list.find('[');
  const auto comma = list.find(',');
  if (bracket == std::string_view::npos || (comma != std::string_view::npos && comma < bracket)) {
    return std::string(list.substr(0, comma));
  }
  const auto close = list.find(']', bracket);
  if (close == std::string_view::npos) {
    fail(Errc::invalid_argument, "SLURM_JOB_NODELIST=\"", list, "\" is malformed (no ']')");
  }
  std::string_view range = list.substr(bracket + 1, close - bracket - 1);
  range = range.substr(0, range.find_first_of(",-"));
  return std::string(list.substr(0, bracket)) + std::string(range);
}

DDP_INLINE void check_rank(const EnvReader&, int rank, int world, const char* rank_var,
                           const char* world_var) {
  if (rank >= world) {
    fail(Errc::invalid_argument, "environment: ", rank_var, "=", rank, " must be less than ",
         world_var, "=", world);
  }
}

}  // namespace detail
DDP_END_NAMESPACE
