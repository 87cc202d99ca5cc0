// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Where a job's rendezvous store is: in an etcd cluster (Options::store, DDP_STORE:
/// open_etcd_store), or rank 0 hosts it on the first free port of its candidates (host_store)
/// and the other ranks find the one that names their job (find_store); the messages say which
/// variable chose the port.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/env.hpp"
#include "ddp/detail/socket.hpp"
#include "ddp/environment.hpp"
#include "ddp/error.hpp"
#include "ddp/store/client.hpp"
#include "ddp/store/etcd.hpp"
#include "ddp/store/server.hpp"

#include <chrono>
#include <memory>
#include <string>
#include <string_view>

DDP_BEGIN_NAMESPACE
namespace detail {

/// Where a job's store port `port` comes from, for the message when it is taken.
[[nodiscard]] DDP_INLINE std::string store_port_source(const Environment& env, int port);

/// What a store on one of several candidate ports says it serves: the job of `env`.
[[nodiscard]] DDP_INLINE std::string store_job_name(const Environment& env);

/// The key under which a store on one of several candidate ports names its job.
inline constexpr std::string_view store_job_key = "ddp/job";

/// Rank 0: hosts the store in `server` on the first free port of [port, port + ports); returns
/// that port.
DDP_INLINE int host_store(std::shared_ptr<StoreServer>& server, const Environment& env, int port,
                          int ports, const StoreOptions& so);

/// Every other rank, when rank 0 may have taken any of [port, port + ports): probes them in turn,
/// with a window that grows each round, until one serves a store that names `job`, or until
/// `deadline` (Errc::timeout).
DDP_INLINE int find_store(const Environment& env, int port, int ports, StoreOptions so,
                          const std::string& job, Clock::time_point deadline);

/// The etcd namespace a launcher gives the job: ddprun's run (DDP_RUN_ID), torchrun's run id
/// (unless "none"), Slurm's job and step; "" when none does.
[[nodiscard]] DDP_INLINE std::string store_namespace();

/// The job's store in the etcd cluster `url` (Options::store), for rank `rank`: its lease as
/// long as the heartbeat (10 s without one). ddp's token authenticates nothing there: a token
/// given is refused rather than ignored.
[[nodiscard]] DDP_INLINE std::shared_ptr<Store> open_etcd_store(const std::string& url, int rank,
                                                                std::chrono::milliseconds heartbeat,
                                                                StoreOptions so);

}  // namespace detail
DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/membership/impl/store_location.ipp"
#endif
