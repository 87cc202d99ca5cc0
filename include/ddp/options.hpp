// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::Options: how a communicator is made (timeouts, the rendezvous secret, transports), as
/// plain data: a default-constructed Options reads nothing and never throws. The environment's
/// DDP_* settings apply through with_env()/from_env(), which Communicator::init calls: each
/// applies to a field left at its default.
///
/// Which backend reads which field (a backend ignores the others):
///   every backend        timeout, token, group, external_store, trace_entries, trace_dump,
///                        timeline
///   with a store         heartbeat, store (backend::Host, backend::Nccl)
///   backend::Host        transport, segment_bytes, shm_single_copy_bytes, verify_collectives,
///                        hierarchy
///   CUDA                 device (backend::Nccl), cuda_staging_bytes (CUDA buffers on a
///                        host-memory backend)
/// They stay in one flat struct, not per-backend structs like c10d's ProcessGroupNCCL::Options:
/// programs build Options with designated initializers (`Options{.timeout = t, .transport =
/// HostTransport::tcp}`), which cannot name a member of a base class or of a nested struct, so
/// moving a field would break them. New backend-specific settings are added at the end, with the
/// backend in their comment.

#include "ddp/config.hpp"
#include "ddp/detail/env.hpp"
#include "ddp/detail/lean_std.hpp"
#include "ddp/error.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

DDP_BEGIN_NAMESPACE

/// How backend::Host moves bytes.
enum class HostTransport : std::uint8_t {
  automatic,  ///< shared memory when every rank is on this host, TCP otherwise
  shm,        ///< shared memory (every rank must be on this host)
  tcp,        ///< TCP, even on one host (what multi-host runs use)
};

/// How backend::Host's all_reduce runs when the ranks span several hosts
/// (HostTransport::automatic). A hierarchical all_reduce reduces inside each host over shared
/// memory and moves only each host's sum over TCP; the others run every rank on the TCP mesh (see
/// README, "Across hosts").
enum class HostHierarchy : std::uint8_t {
  automatic,  ///< `slices` when every host runs as many ranks, else `leaders`; flat on one host
  flat,       ///< every rank on the TCP mesh (the order of a single host: ranks 0..P-1)
  slices,     ///< local rank i of every host carries slice i across (equal ranks per host)
  leaders,    ///< the lowest rank of each host carries the host's whole sum across
};

/// How Communicator::shrink forms a communicator of the ranks that survived a failure.
struct ShrinkOptions {
  /// How long the survivors wait for a rank that has neither said it is alive nor died (stopped,
  /// or slow to notice the failure) before leaving it out; 0: the communicator's timeout. Make
  /// it longer than the longest stretch between two collectives (a step).
  std::chrono::milliseconds wait_for_ranks{0};
  /// Ranks (of the communicator being shrunk) known to be lost: not waited for, left out.
  std::vector<int> exclude{};
};

/// How Communicator::grow admits the processes waiting to enter the job.
struct GrowOptions {
  /// What a newcomer must bring to be admitted: its EnterOptions::ticket must be equal
  /// (TrainingState::ticket() describes the state the program tracks). Others are refused.
  std::string ticket{};
};

/// How Communicator::enter asks to enter a running job.
struct EnterOptions {
  /// Compared with the members' GrowOptions::ticket (see there).
  std::string ticket{};
  /// How long to wait to be admitted (the members admit newcomers at their next grow()); 0: the
  /// communicator's timeout. The request is withdrawn when it passes.
  std::chrono::milliseconds wait{0};
};
/// The older name of EnterOptions (Communicator::join is Communicator::enter's).
using JoinOptions [[deprecated("renamed EnterOptions, as Communicator::join is now enter")]] =
    EnterOptions;

/// How a communicator is made and behaves: timeouts, the rendezvous secret, transports,
/// verification and the flight recorder (see the file comment for which backend reads what).
struct Options {
  /// The longest any single wait may take (a collective, the rendezvous, a store call) before
  /// Errc::timeout. A peer that dies is reported sooner (Errc::peer_lost). Default: 5 minutes
  /// ($DDP_TIMEOUT: seconds).
  std::chrono::milliseconds timeout = std::chrono::minutes(5);
  /// Rendezvous secret: every rank must present it to the store ($DDP_TOKEN).
  std::string token{};
  /// CUDA device for CUDA backends; -1: the local rank.
  int device = -1;
  /// Name of this communicator in the store; communicators made from the same store (a new one
  /// after a failure, say) need different names.
  std::string group = "default";
  /// backend::Host transport ($DDP_HOST_TRANSPORT: shm, tcp or auto).
  HostTransport transport = HostTransport::automatic;
  /// backend::Host: bytes one rank moves per round (the shared-memory slot size, the TCP
  /// segment). 0: the transport's default (shm 1 MiB, tcp 1 MiB) ($DDP_SEGMENT_BYTES: 4096 to
  /// 2^40). Shared-memory slots are capped at 64 MiB. Every rank must use the same value.
  std::size_t segment_bytes = 0;
  /// backend::Host on shared memory: an all_reduce of at least this many bytes copies straight
  /// out of the peers' memory (single copy: process_vm_readv) instead of through shared memory,
  /// where the kernel lets the ranks read each other's memory (else, silently, it does not).
  /// 0, the default: from 64 KiB rank 0 times both paths for each size and takes the faster,
  /// retrying the other now and then (which wins depends on the size and on the machine's state:
  /// bench/README.md, "Shared memory at mid sizes"); the results are the same bits either way.
  /// A number: single copy always from that many bytes. Options::never: off
  /// ($DDP_SHM_SINGLE_COPY: auto, a number of bytes, or off). Every rank must use the same value.
  std::size_t shm_single_copy_bytes = 0;
  /// shm_single_copy_bytes: single copy off.
  static constexpr std::size_t never = ~std::size_t{0};
  /// The rendezvous store runs elsewhere: rank 0 does not start one. Launchers that host the
  /// store (ddprun, ddp::spawn) say so with DDP_STORE_HOSTED=1, which init() also honours.
  bool external_store = false;
  /// CUDA buffers given to a backend that moves host memory only (backend::Host, a backend::Mpi
  /// whose MPI is not CUDA-aware) go through pinned host memory in pieces of this many bytes, so
  /// that copies overlap the collective (ddp built with CUDA: the ddp::cuda target).
  std::size_t cuda_staging_bytes = std::size_t{4} << 20;
  /// backend::Host compares every collective's fingerprint (collective, dtype, count, op, root,
  /// sequence number) across ranks, so that mismatched calls raise Errc::mismatch on every rank
  /// instead of corrupting data or hanging. Every rank must use the same setting. Default: on
  /// ($DDP_VERIFY_COLLECTIVES: 1 or 0, also true/false, on/off, yes/no) (what it costs: README,
  /// "Diagnostics").
  bool verify_collectives = true;
  /// How many recent operations each communicator remembers (the flight recorder, see
  /// observe/recorder.hpp); 0 turns it off ($DDP_TRACE_ENTRIES: 0 to 10^6).
  std::size_t trace_entries = 2000;
  /// Where a communicator writes its flight recorder when an operation times out: "" nowhere,
  /// "stderr", or a directory (one file per rank) ($DDP_TRACE_DUMP).
  std::string trace_dump{};
  /// backend::Host: the all_reduce across hosts (see HostHierarchy; $DDP_HIERARCHY: auto, flat,
  /// slices or leaders). Every rank must use the same value.
  HostHierarchy hierarchy = HostHierarchy::automatic;
  /// Heartbeat: a process that sends no sign of life to the rendezvous store for this long
  /// (stopped, hung, or cut off from the store) counts as lost, as if it had died: its peers'
  /// collectives fail with Errc::peer_lost naming it within about 1.2 heartbeats, whatever the
  /// timeout, shrink() does not wait for it, and it is fenced when it wakes. A thread of each
  /// process signs every heartbeat / 5. 0: none (a stopped rank is noticed at the timeout). Every
  /// rank should use the same value ($DDP_HEARTBEAT: seconds, or 0).
  std::chrono::milliseconds heartbeat = std::chrono::seconds(5);
  /// Where the rendezvous store is: "" for ddp's own (rank 0 hosts it at MASTER_ADDR:
  /// MASTER_PORT, or the launcher does), or an etcd cluster, "etcd://HOST:PORT[,HOST:PORT...]
  /// [/NAMESPACE]" (no process of the job is then a single point of failure: losing rank 0 is
  /// recovered from like any other loss). The namespace defaults to the launcher's run id
  /// (ddprun's, TORCHELASTIC_RUN_ID, Slurm's job and step); it must be new for each run. Every
  /// rank must give the same ($DDP_STORE).
  std::string store{};
  /// A directory where every process writes its timeline, Chrome trace-event JSON that Perfetto
  /// and chrome://tracing open (observe/timeline.hpp; `ddp-trace DIR` merges the ranks' files and
  /// draws a step); "" records nothing ($DDP_TIMELINE). The first communicator a process makes
  /// with it starts the file; later ones write into it.
  std::string timeline{};

  /// These options with the environment's settings (the $ names above) applied to every field
  /// still at its default. A malformed value is Errc::invalid_argument naming the variable.
  /// Communicator::init applies it to the Options it is given.
  [[nodiscard]] Options with_env(const detail::EnvReader& env = detail::EnvReader()) const;

  /// The same, going on past a malformed variable (its field keeps its value): `error` gets the
  /// first one. What Communicator::init uses, so that a rank can still join the rendezvous and
  /// tell the others why it fails.
  [[nodiscard]] Options with_env(const detail::EnvReader& env, std::exception_ptr& error) const;

  /// Default options with the environment's settings (Options{}.with_env(env)).
  [[nodiscard]] static Options from_env(const detail::EnvReader& env = detail::EnvReader()) {
    return Options{}.with_env(env);
  }
};

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/impl/options.ipp"
#endif
