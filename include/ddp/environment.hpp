// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// ddp::Environment: who am I? Read from the variables a launcher sets — ddprun and torchrun
/// (RANK, WORLD_SIZE, ...), Slurm (SLURM_PROCID, ...), Open MPI (OMPI_COMM_WORLD_*), MPICH/PMI
/// (PMI_RANK, ...) — or, with no launcher, rank 0 of a world of 1.

#include "ddp/config.hpp"
#if !DDP_HAS_EXCEPTIONS
#error DDP_REQUIRE_EXCEPTIONS_MESSAGE
#endif
#include "ddp/detail/env.hpp"
#include "ddp/error.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

DDP_BEGIN_NAMESPACE

/// Where a process stands in the job, and where the rendezvous store is.
struct Environment {
  int rank = 0;              ///< this process's rank in the job (RANK)
  int world_size = 1;        ///< the number of processes (WORLD_SIZE)
  int local_rank = 0;        ///< this process's rank on its host (LOCAL_RANK)
  int local_world_size = 1;  ///< processes on this host (LOCAL_WORLD_SIZE)
  int node_rank = 0;         ///< this host's index in the job (NODE_RANK)
  /// Host of rank 0's rendezvous store (MASTER_ADDR). Empty when an MPI launcher (mpirun, hydra,
  /// MVAPICH) runs the job across hosts and MASTER_ADDR is not set: MPI does not say which host
  /// rank 0 is on, and Communicator<backend::Host>::init then fails saying what to export.
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  ///< 0: not set (only allowed when world_size == 1 or under MPI)
  /// The port of ddp's rendezvous store on master_addr: DDP_STORE_PORT when set; under torchrun,
  /// whose agent already serves its own (c10d) store on MASTER_PORT, MASTER_PORT + 1; otherwise
  /// master_port.
  int store_port = 0;
  /// How many consecutive ports from store_port rank 0 may host the store on, the first free one
  /// (every other rank probes them for the job's store). 1, except under torchrun when the port is
  /// MASTER_PORT + 1: torchrun's agent picked MASTER_PORT as a free ephemeral port, and its
  /// neighbour may be held by any connection on the host; then 8.
  int store_ports = 1;
  /// The launcher restarted this process to join the running job (DDP_REJOIN=N, its N-th
  /// restart: ddprun --on-failure rejoin): make the communicator with Communicator::enter.
  bool rejoin = false;
  /// Which launcher the values came from: "ddprun", "torchrun", "slurm", "openmpi", "pmi"
  /// (MPICH, Intel MPI), "mvapich", "none"; "unknown" when variables of a launcher ddp cannot read
  /// fully were seen (then `warning` says which, and the values are those of a world of 1).
  std::string launcher = "none";
  /// Non-empty when the environment looks like a launcher's that ddp could not read (PMIX_RANK
  /// without a world size, LOCAL_RANK alone): what was seen and what to do. detect() prints it to
  /// stderr; detect(lookup) leaves that to the caller.
  std::string warning;

  /// Reads the process environment. Never throws when no launcher variable is set; throws
  /// Errc::invalid_argument naming the variable when one is malformed or inconsistent.
  [[nodiscard]] static Environment detect();

  /// The same, from any lookup function (returns nullptr for unset names): for tests and for
  /// programs that keep their configuration elsewhere.
  [[nodiscard]] static Environment detect(const std::function<const char*(const char*)>& lookup);
};

namespace detail {

/// The number of tasks on node `node` from a Slurm task layout: "2(x3),1" means 2, 2, 2, 1.
/// nullopt when it does not parse or has no such node.
[[nodiscard]] DDP_INLINE std::optional<int> slurm_tasks_on_node(std::string_view layout, int node);

/// The first host name of a Slurm node list: "gpu[07-09,12],cpu3" -> "gpu07".
[[nodiscard]] DDP_INLINE std::string first_slurm_host(std::string_view list);

DDP_INLINE void check_rank(const EnvReader&, int rank, int world, const char* rank_var,
                           const char* world_var);

}  // namespace detail

inline Environment Environment::detect(const std::function<const char*(const char*)>& lookup) {
  constexpr int max_world = 1 << 24;
  const detail::EnvReader env(lookup);
  Environment e;

  const auto fill_master = [&](bool required) {
    if (auto addr = env.str("MASTER_ADDR")) {
      e.master_addr = *addr;
    } else if (e.launcher != "slurm" && !required && e.local_world_size < e.world_size) {
      e.master_addr.clear();  // an MPI job across hosts: rank 0's host is unknown
    }
    if (auto port = env.integer("MASTER_PORT", 1, 65535)) {
      e.master_port = *port;
    } else if (required && e.world_size > 1 && !env.str("DDP_STORE")) {  // etcd: none needed
      detail::fail(Errc::invalid_argument, "environment: WORLD_SIZE=", e.world_size,
                   " but MASTER_PORT is not set; export MASTER_ADDR and MASTER_PORT (ddprun and "
                   "torchrun do this for you)");
    }
  };

  if (env.has("RANK") || env.has("WORLD_SIZE")) {  // ddprun / torchrun / torch.distributed.launch
    e.launcher = env.has("DDP_LAUNCHER") ? "ddprun" : "torchrun";
    const auto rank = env.integer("RANK", 0, max_world - 1);
    const auto world = env.integer("WORLD_SIZE", 1, max_world);
    if (!rank)
      detail::fail(Errc::invalid_argument, "environment: WORLD_SIZE is set but RANK is not");
    if (!world)
      detail::fail(Errc::invalid_argument, "environment: RANK is set but WORLD_SIZE is not");
    e.rank = *rank;
    e.world_size = *world;
    detail::check_rank(env, e.rank, e.world_size, "RANK", "WORLD_SIZE");
    e.local_world_size = env.integer("LOCAL_WORLD_SIZE", 1, max_world).value_or(e.world_size);
    e.local_rank =
        env.integer("LOCAL_RANK", 0, max_world - 1).value_or(e.rank % e.local_world_size);
    detail::check_rank(env, e.local_rank, e.local_world_size, "LOCAL_RANK", "LOCAL_WORLD_SIZE");
    if (e.local_world_size > e.world_size) {
      detail::fail(Errc::invalid_argument, "environment: LOCAL_WORLD_SIZE=", e.local_world_size,
                   " is larger than WORLD_SIZE=", e.world_size);
    }
    auto node = env.integer("NODE_RANK", 0, max_world - 1);
    if (!node) node = env.integer("GROUP_RANK", 0, max_world - 1);
    e.node_rank = node.value_or(e.rank / e.local_world_size);
    fill_master(/*required=*/true);
  } else if (env.has("OMPI_COMM_WORLD_RANK")) {  // Open MPI's mpirun
    e.launcher = "openmpi";
    e.world_size = env.integer("OMPI_COMM_WORLD_SIZE", 1, max_world).value_or(1);
    e.rank = *env.integer("OMPI_COMM_WORLD_RANK", 0, max_world - 1);
    detail::check_rank(env, e.rank, e.world_size, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
    e.local_world_size =
        env.integer("OMPI_COMM_WORLD_LOCAL_SIZE", 1, max_world).value_or(e.world_size);
    e.local_rank = env.integer("OMPI_COMM_WORLD_LOCAL_RANK", 0, max_world - 1).value_or(0);
    detail::check_rank(env, e.local_rank, e.local_world_size, "OMPI_COMM_WORLD_LOCAL_RANK",
                       "OMPI_COMM_WORLD_LOCAL_SIZE");
    // Not OMPI_COMM_WORLD_NODE_RANK: despite its name it ranks processes within a node (across
    // jobs). With mpirun's default by-slot mapping, ranks fill the nodes in order.
    e.node_rank = e.rank / e.local_world_size;
    fill_master(/*required=*/false);
  } else if (env.has("PMI_RANK")) {  // MPICH / Intel MPI (hydra)
    e.launcher = "pmi";
    e.world_size = env.integer("PMI_SIZE", 1, max_world).value_or(1);
    e.rank = *env.integer("PMI_RANK", 0, max_world - 1);
    detail::check_rank(env, e.rank, e.world_size, "PMI_RANK", "PMI_SIZE");
    e.local_world_size = env.integer("MPI_LOCALNRANKS", 1, max_world).value_or(e.world_size);
    e.local_rank = env.integer("MPI_LOCALRANKID", 0, max_world - 1).value_or(0);
    detail::check_rank(env, e.local_rank, e.local_world_size, "MPI_LOCALRANKID", "MPI_LOCALNRANKS");
    e.node_rank = e.rank / e.local_world_size;
    fill_master(/*required=*/false);
  } else if (env.has("SLURM_PROCID")) {  // srun
    e.launcher = "slurm";
    e.world_size = env.integer("SLURM_NTASKS", 1, max_world).value_or(1);
    e.rank = *env.integer("SLURM_PROCID", 0, max_world - 1);
    detail::check_rank(env, e.rank, e.world_size, "SLURM_PROCID", "SLURM_NTASKS");
    e.local_rank = env.integer("SLURM_LOCALID", 0, max_world - 1).value_or(0);
    e.node_rank = env.integer("SLURM_NODEID", 0, max_world - 1).value_or(0);
    // The tasks on this node: the step's layout (srun), else the job's, each like "2(x2),1"
    // (2 on nodes 0 and 1, 1 on node 2), indexed by this node; else SLURM_NTASKS_PER_NODE; else
    // one node.
    e.local_world_size = e.world_size;
    const char* local_from = "SLURM_NTASKS";
    for (const char* name :
         {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"}) {
      if (auto v = env.str(name)) {
        if (auto n = detail::slurm_tasks_on_node(*v, e.node_rank)) {
          e.local_world_size = *n;
          local_from = name;
          break;
        }
      }
    }
    detail::check_rank(env, e.local_rank, e.local_world_size, "SLURM_LOCALID", local_from);
    if (!env.has("MASTER_ADDR")) {
      if (auto nodes = env.str("SLURM_JOB_NODELIST"))
        e.master_addr = detail::first_slurm_host(*nodes);
    }
    fill_master(/*required=*/false);
    if (e.master_port == 0) {
      // Same on every task of the step; different between jobs, and between the steps of one
      // job (which may run at once on a node). Below the kernel's ephemeral ports (32768-),
      // where a connecting socket can never be given it as its own source port.
      if (auto job = env.integer("SLURM_JOB_ID", 0, 2147483647)) {
        const auto step = env.integer("SLURM_STEP_ID", 0, 2147483647).value_or(0);
        e.master_port = 15000 + static_cast<int>((static_cast<std::uint64_t>(*job) * 7919U +
                                                  static_cast<std::uint64_t>(step)) %
                                                 17000U);
      }
    }
  } else if (env.has("MV2_COMM_WORLD_RANK")) {  // MVAPICH2's mpirun_rsh / mpiexec
    e.launcher = "mvapich";
    e.world_size = env.integer("MV2_COMM_WORLD_SIZE", 1, max_world).value_or(1);
    e.rank = *env.integer("MV2_COMM_WORLD_RANK", 0, max_world - 1);
    detail::check_rank(env, e.rank, e.world_size, "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE");
    e.local_world_size =
        env.integer("MV2_COMM_WORLD_LOCAL_SIZE", 1, max_world).value_or(e.world_size);
    e.local_rank = env.integer("MV2_COMM_WORLD_LOCAL_RANK", 0, max_world - 1).value_or(0);
    detail::check_rank(env, e.local_rank, e.local_world_size, "MV2_COMM_WORLD_LOCAL_RANK",
                       "MV2_COMM_WORLD_LOCAL_SIZE");
    e.node_rank = e.rank / e.local_world_size;
    fill_master(/*required=*/false);
  } else if (env.has("PMIX_RANK") || env.has("LOCAL_RANK")) {
    // A launcher ddp cannot read fully: PMIx gives a rank but no world size in the environment
    // (Open MPI 5 and srun --mpi=pmix also set the variables above); LOCAL_RANK alone comes from
    // launchers that set nothing else. Run as a world of 1, but say so: in the quickstart
    // pattern (spawn when there is no launcher) every process would otherwise fork a job.
    e.launcher = "unknown";
    const char* seen = env.has("PMIX_RANK") ? "PMIX_RANK" : "LOCAL_RANK";
    e.warning = detail::concat(
        "ddp: ", seen,
        " is set, but not the variables ddp reads a job from (RANK and WORLD_SIZE, "
        "OMPI_COMM_WORLD_*, PMI_RANK/PMI_SIZE, MV2_COMM_WORLD_*, SLURM_PROCID); this process "
        "runs as rank 0 of a world of 1. Launch with ddprun, torchrun, srun or mpirun, or export "
        "RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.");
  }
  e.store_port = e.master_port;
  e.rejoin = env.integer("DDP_REJOIN", 0, 1 << 30).value_or(0) > 0;
  if (auto port = env.integer("DDP_STORE_PORT", 1, 65535)) {
    e.store_port = *port;
  } else if (e.launcher == "torchrun" && e.master_port != 0 &&
             env.str("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True") {
    if (e.master_port == 65535)
      detail::fail(Errc::invalid_argument,
                   "environment: under torchrun ddp's store listens on MASTER_PORT + 1, but "
                   "MASTER_PORT is 65535; pick another port or set DDP_STORE_PORT");
    e.store_port = e.master_port + 1;
    e.store_ports = std::min(8, 65536 - e.store_port);
  }
  return e;
}

inline Environment Environment::detect() {
  Environment e = detect([](const char* name) -> const char* { return std::getenv(name); });
  if (!e.warning.empty()) std::fprintf(stderr, "%s\n", e.warning.c_str());
  return e;
}

DDP_END_NAMESPACE

#if DDP_BODIES
#include "ddp/impl/environment.ipp"
#endif
