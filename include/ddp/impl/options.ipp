// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/options.hpp>'s non-template functions. That header includes this file at its
// bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

DDP_BEGIN_NAMESPACE

DDP_INLINE Options Options::with_env(const detail::EnvReader& env) const {
  std::exception_ptr error;
  Options o = with_env(env, error);
  if (error) std::rethrow_exception(error);
  return o;
}

DDP_INLINE Options Options::with_env(const detail::EnvReader& env,
                                     std::exception_ptr& error) const {
  Options o = *this;
  const Options defaults;
  const auto apply = [&](auto&& f) {
    try {
      f();
    } catch (const Error&) {
      if (!error) error = std::current_exception();
    }
  };
  apply([&] {
    if (o.timeout == defaults.timeout) o.timeout = env.seconds("DDP_TIMEOUT").value_or(o.timeout);
  });
  if (o.token.empty()) o.token = env.get("DDP_TOKEN");
  apply([&] {
    if (o.transport != HostTransport::automatic) return;
    const std::string t = env.get("DDP_HOST_TRANSPORT");
    if (t == "tcp")
      o.transport = HostTransport::tcp;
    else if (t == "shm")
      o.transport = HostTransport::shm;
    else if (!t.empty() && t != "auto")
      detail::fail(Errc::invalid_argument, "DDP_HOST_TRANSPORT=\"", t, "\": use shm, tcp or auto");
  });
  apply([&] {
    if (o.segment_bytes != 0) return;
    o.segment_bytes =
        static_cast<std::size_t>(env.whole_number("DDP_SEGMENT_BYTES", 4096, std::uint64_t{1} << 40,
                                                  "a number of bytes in [4096, 2^40]")
                                     .value_or(0));
  });
  apply([&] {
    if (o.shm_single_copy_bytes != 0) return;
    const std::string v = env.get("DDP_SHM_SINGLE_COPY");
    if (v == "auto") return;  // 0: the default
    o.shm_single_copy_bytes =
        v == "off" ? never
                   : static_cast<std::size_t>(
                         env.whole_number("DDP_SHM_SINGLE_COPY", 1, std::uint64_t{1} << 40,
                                          "a number of bytes in [1, 2^40], auto or off")
                             .value_or(0));
  });
  apply([&] {
    if (o.verify_collectives == defaults.verify_collectives)
      o.verify_collectives = env.flag("DDP_VERIFY_COLLECTIVES").value_or(o.verify_collectives);
  });
  apply([&] {
    if (o.trace_entries != defaults.trace_entries) return;
    o.trace_entries = static_cast<std::size_t>(
        env.whole_number("DDP_TRACE_ENTRIES", 0, 1000000,
                         "a number of records in [0, 1000000] (0 turns the flight recorder "
                         "off)")
            .value_or(o.trace_entries));
  });
  if (o.trace_dump.empty()) o.trace_dump = env.get("DDP_TRACE_DUMP");
  if (o.store.empty()) o.store = env.get("DDP_STORE");
  if (o.timeline.empty()) o.timeline = env.get("DDP_TIMELINE");
  apply([&] {
    if (o.heartbeat != defaults.heartbeat) return;
    if (const std::string v = env.get("DDP_HEARTBEAT"); v == "0" || v == "off")
      o.heartbeat = std::chrono::milliseconds(0);
    else
      o.heartbeat = env.seconds("DDP_HEARTBEAT").value_or(o.heartbeat);
  });
  apply([&] {
    if (o.hierarchy != HostHierarchy::automatic) return;
    const std::string h = env.get("DDP_HIERARCHY");
    if (h == "flat")
      o.hierarchy = HostHierarchy::flat;
    else if (h == "slices")
      o.hierarchy = HostHierarchy::slices;
    else if (h == "leaders")
      o.hierarchy = HostHierarchy::leaders;
    else if (!h.empty() && h != "auto")
      detail::fail(Errc::invalid_argument, "DDP_HIERARCHY=\"", h,
                   "\": use auto, flat, slices or leaders");
  });
  return o;
}

DDP_END_NAMESPACE
