// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/membership/store_location.hpp>'s non-template functions. That header includes
// this file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <algorithm>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::string store_port_source(const Environment& env, int port) {
  if (port == env.master_port) return concat("takes MASTER_PORT = ", port);
  if (env.launcher == "torchrun" && port == env.master_port + 1)
    return concat("takes MASTER_PORT + 1 = ", port,
                  " under torchrun (torchrun's agent serves its own store on MASTER_PORT ",
                  env.master_port, ")");
  return concat("takes DDP_STORE_PORT = ", port);
}

DDP_INLINE std::string store_job_name(const Environment& env) {
  const EnvReader launcher;
  return concat(env.master_addr, ":", env.master_port, "/", launcher.get("TORCHELASTIC_RUN_ID", ""),
                "/", launcher.get("TORCHELASTIC_RESTART_COUNT", "0"));
}

DDP_INLINE int host_store(std::shared_ptr<StoreServer>& server, const Environment& env, int port,
                          int ports, const StoreOptions& so) {
  for (int p = port; p < port + ports; ++p) {
    try {
      server = std::make_shared<StoreServer>(env.master_addr, p, so);
      return p;
    } catch (const Error& e) {
      if (e.code() != Errc::address_in_use) throw;
    }
  }
  fail(Errc::address_in_use, "rank 0: cannot host ddp's rendezvous store at ",
       host_port(env.master_addr, port),
       ports > 1 ? concat(" (nor on the ", ports - 1, " ports after it)") : std::string(),
       ": the port is in use. ddp's store ", store_port_source(env, port),
       "; another job, a run that has not exited or a second process started with RANK=0 "
       "holds it. Set DDP_STORE_PORT to a free port (the same on every rank)",
       port == env.master_port ? ", or choose another MASTER_PORT" : "");
}

DDP_INLINE int find_store(const Environment& env, int port, int ports, StoreOptions so,
                          const std::string& job, Clock::time_point deadline) {
  const auto timeout = so.timeout;
  so.refusal_key.clear();  // a probe never marks a store it turns out not to belong to
  auto window = std::chrono::milliseconds(100);
  for (;;) {
    for (int p = port; p < port + ports; ++p) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left <= std::chrono::milliseconds(0)) {
        fail(Errc::timeout, "rank ", env.rank, ": no rendezvous store of this job answered on ",
             host_port(env.master_addr, port), " or the ", ports - 1,
             " ports after it within the timeout (", timeout.count(),
             " ms): is rank 0 running? ddp's store ", store_port_source(env, port),
             "; set DDP_STORE_PORT to a free port (the same on every rank) to name it");
      }
      so.timeout = std::min(window, left);
      try {
        Store probe(env.master_addr, p, so);
        if (probe.get(store_job_key) == job) return p;
      } catch (const Error&) {
        // nothing there yet, another program, or another job's store: the next port
      }
    }
    window = std::min(window * 2, std::chrono::milliseconds(2000));
  }
}

DDP_INLINE std::string store_namespace() {
  const EnvReader e;
  if (std::string id = e.get("DDP_RUN_ID"); !id.empty()) return id;
  if (std::string id = e.get("TORCHELASTIC_RUN_ID"); !id.empty() && id != "none")
    return concat("torchrun-", id, "-", e.get("TORCHELASTIC_RESTART_COUNT", "0"));
  if (std::string job = e.get("SLURM_JOB_ID"); !job.empty())
    return concat("slurm-", job, ".", e.get("SLURM_STEP_ID", "0"));
  return {};
}

DDP_INLINE std::shared_ptr<Store> open_etcd_store(const std::string& url, int rank,
                                                  std::chrono::milliseconds heartbeat,
                                                  StoreOptions so) {
  if (!so.token.empty())
    fail(Errc::invalid_argument, "rank ", rank, ": DDP_STORE=\"", url,
         "\": DDP_TOKEN is set, but an etcd store does not check ddp's token (secure the etcd "
         "cluster itself, and keep it on a private network); unset DDP_TOKEN to use it");
  so.lease_ttl = heartbeat.count() > 0 ? heartbeat : std::chrono::milliseconds(10000);
  return std::make_shared<Store>(connect_etcd(url, "DDP_STORE", store_namespace(), std::move(so)));
}

}  // namespace detail
DDP_END_NAMESPACE
