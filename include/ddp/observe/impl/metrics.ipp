// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/observe/metrics.hpp>'s non-template functions. That header includes this file
// at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cmath>
#include <cstdio>
#include <cstring>

DDP_BEGIN_NAMESPACE

DDP_INLINE auto MetricValues::entry(std::string_view name) const -> const Entry& {
  for (const Entry& e : entries_) {
    if (e.name == name) return e;
  }
  detail::fail(Errc::invalid_argument, "MetricValues: no metric named \"", name,
               "\" (recorded: ", names(), ")");
}

DDP_INLINE bool MetricValues::contains(std::string_view name) const noexcept {
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const Entry& e) { return e.name == name; });
}

DDP_INLINE std::string MetricValues::format(int digits) const {
  std::string out;
  for (const Entry& e : entries_) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*g", std::clamp(digits, 1, 17), e.value);
    if (!out.empty()) out += "  ";
    out += e.name;
    out += ' ';
    out += buf;
  }
  return out;
}

DDP_INLINE std::string MetricValues::names() const {
  std::string s;
  for (const Entry& e : entries_) s += (s.empty() ? "" : ", ") + e.name;
  return s.empty() ? std::string("none") : s;
}

DDP_INLINE Metrics& Metrics::sum(std::string_view name, double value) {
  Slot& s = slot(name, MetricKind::sum);
  s.a += value;
  s.b += 1;
  return *this;
}

DDP_INLINE Metrics& Metrics::mean(std::string_view name, double value, double weight) {
  if (!(weight >= 0) || !std::isfinite(weight)) {
    detail::fail(Errc::invalid_argument, "Metrics::mean(\"", name, "\"): the weight ", weight,
                 " must be finite and non-negative (a number of samples)");
  }
  Slot& s = slot(name, MetricKind::mean);
  if (weight > 0) {
    s.a += value * weight;
    s.b += weight;
  }
  return *this;
}

DDP_INLINE Metrics& Metrics::min(std::string_view name, double value) {
  Slot& s = slot(name, MetricKind::min);
  s.a = s.b == 0 ? value : std::min(s.a, value);
  s.b += 1;
  return *this;
}

DDP_INLINE Metrics& Metrics::max(std::string_view name, double value) {
  Slot& s = slot(name, MetricKind::max);
  s.a = s.b == 0 ? value : std::max(s.a, value);
  s.b += 1;
  return *this;
}

DDP_INLINE MetricValues Metrics::local() const {
  MetricValues v;
  for (const Slot& s : slots_)
    v.entries_.push_back({s.name, s.kind, value_of(s.kind, s.a, s.b), s.b});
  return v;
}

DDP_INLINE auto Metrics::slot(std::string_view name, MetricKind kind) -> Slot& {
  for (Slot& s : slots_) {
    if (s.name != name) continue;
    if (s.kind != kind) {
      detail::fail(Errc::invalid_argument, "Metrics: \"", name, "\" was recorded as a ",
                   to_string(s.kind), " and now as a ", to_string(kind),
                   "; a name keeps its kind (clear() forgets it)");
    }
    return s;
  }
  if (name.empty()) detail::fail(Errc::invalid_argument, "Metrics: a metric needs a name");
  slots_.push_back({std::string(name), kind});
  return slots_.back();
}

DDP_INLINE double Metrics::value_of(MetricKind kind, double a, double b) {
  if (kind == MetricKind::mean) return b > 0 ? a / b : std::numeric_limits<double>::quiet_NaN();
  if ((kind == MetricKind::min || kind == MetricKind::max) && b == 0)
    return std::numeric_limits<double>::quiet_NaN();
  return a;
}

DDP_INLINE std::string_view Metrics::to_string(MetricKind k) noexcept {
  switch (k) {
    case MetricKind::sum: return "sum";
    case MetricKind::mean: return "mean";
    case MetricKind::min: return "min";
    case MetricKind::max: return "max";
  }
  return "?";
}

DDP_INLINE std::uint64_t Metrics::digest() const noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  const auto mix = [&](unsigned char c) {
    h ^= c;
    h *= 0x100000001b3ull;
  };
  for (const Slot& s : slots_) {
    for (char c : s.name) mix(static_cast<unsigned char>(c));
    mix(0);
    mix(static_cast<unsigned char>(s.kind));
  }
  return h;
}

DDP_INLINE std::string Metrics::describe() const {
  std::string s;
  for (const Slot& x : slots_)
    s += detail::concat(s.empty() ? "" : ", ", x.name, " (", to_string(x.kind), ")");
  return s.empty() ? std::string("no metrics") : "this rank has " + s;
}

DDP_END_NAMESPACE
