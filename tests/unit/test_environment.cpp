#include <ddp/environment.hpp>
#include <ddp/options.hpp>
#include <ddp/trace.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <string>

namespace {

ddp::Environment detect(const std::map<std::string, std::string>& vars) {
  return ddp::Environment::detect([&](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    (void)detect(vars);
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("environment: no launcher means rank 0 of 1") {
  const auto e = detect({});
  CHECK(e.rank == 0);
  CHECK(e.world_size == 1);
  CHECK(e.local_rank == 0);
  CHECK(e.local_world_size == 1);
  CHECK(e.node_rank == 0);
  CHECK(e.launcher == "none");
  CHECK(e.master_port == 0);
  (void)ddp::Environment::detect();  // the real environment never throws without a launcher
}

TEST_CASE("environment: torchrun / ddprun variables") {
  const auto e = detect({{"RANK", "5"},
                         {"WORLD_SIZE", "8"},
                         {"LOCAL_RANK", "1"},
                         {"LOCAL_WORLD_SIZE", "4"},
                         {"GROUP_RANK", "1"},
                         {"MASTER_ADDR", "10.0.0.7"},
                         {"MASTER_PORT", "29500"}});
  CHECK(e.rank == 5);
  CHECK(e.world_size == 8);
  CHECK(e.local_rank == 1);
  CHECK(e.local_world_size == 4);
  CHECK(e.node_rank == 1);
  CHECK(e.master_addr == "10.0.0.7");
  CHECK(e.master_port == 29500);
  CHECK(e.launcher == "torchrun");
  const auto d = detect({{"RANK", "0"},
                         {"WORLD_SIZE", "2"},
                         {"MASTER_PORT", "1234"},
                         {"NODE_RANK", "0"},
                         {"DDP_LAUNCHER", "ddprun"}});
  CHECK(d.launcher == "ddprun");
  CHECK(d.master_addr == "127.0.0.1");
  CHECK(d.local_world_size == 2);  // defaults to the world
  CHECK(d.local_rank == 0);
}

TEST_CASE("environment: the store port (torchrun's agent holds MASTER_PORT)") {
  const std::map<std::string, std::string> base{
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}};
  CHECK(detect(base).store_port == 29500);
  auto torchrun = base;
  torchrun["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  CHECK(detect(torchrun).master_port == 29500);
  CHECK(detect(torchrun).store_port == 29501);
  CHECK(detect(torchrun).store_ports == 8);  // the agent's port's neighbours may be taken
  CHECK(detect(base).store_ports == 1);
  auto ddprun = torchrun;
  ddprun["DDP_LAUNCHER"] = "ddprun";  // ddprun's agent hosts ddp's own store on MASTER_PORT
  CHECK(detect(ddprun).store_port == 29500);
  auto explicit_port = torchrun;
  explicit_port["DDP_STORE_PORT"] = "31000";
  CHECK(detect(explicit_port).store_port == 31000);
  CHECK(detect(explicit_port).store_ports == 1);
  auto near_top = torchrun;
  near_top["MASTER_PORT"] = "65530";
  CHECK(detect(near_top).store_ports == 5);
  torchrun["MASTER_PORT"] = "65535";
  CHECK(error_of(torchrun).find("DDP_STORE_PORT") != std::string::npos);
  explicit_port["DDP_STORE_PORT"] = "0";
  CHECK(error_of(explicit_port).find("DDP_STORE_PORT") != std::string::npos);
}

TEST_CASE("environment: Slurm, Open MPI and MPICH") {
  const auto s = detect({{"SLURM_PROCID", "3"},
                         {"SLURM_NTASKS", "4"},
                         {"SLURM_LOCALID", "1"},
                         {"SLURM_NTASKS_PER_NODE", "2(x2)"},
                         {"SLURM_NODEID", "1"},
                         {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                         {"SLURM_JOB_ID", "4242"}});
  CHECK(s.launcher == "slurm");
  CHECK(s.rank == 3);
  CHECK(s.world_size == 4);
  CHECK(s.local_rank == 1);
  CHECK(s.local_world_size == 2);
  CHECK(s.node_rank == 1);
  CHECK(s.master_addr == "gpu07");
  // The store port: the same for every task of a step, different between steps of one job
  // (SLURM_STEP_ID) and between jobs, below the ephemeral range.
  CHECK(s.master_port >= 15000);
  CHECK(s.master_port < 32768);
  const auto slurm_port = [](const char* job, const char* step) {
    std::map<std::string, std::string> v{
        {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_JOB_ID", job}};
    if (step != nullptr) v["SLURM_STEP_ID"] = step;
    return detect(v).master_port;
  };
  CHECK(slurm_port("4242", nullptr) == s.master_port);
  CHECK(slurm_port("4242", "0") == s.master_port);
  CHECK(slurm_port("4242", "1") != s.master_port);
  CHECK(slurm_port("4242", "2") != slurm_port("4242", "1"));
  CHECK(slurm_port("4243", "0") != s.master_port);
  // An uneven layout: SLURM_TASKS_PER_NODE=2(x2),1 has 1 task on node 2 (not 2).
  const auto uneven = detect({{"SLURM_PROCID", "4"},
                              {"SLURM_NTASKS", "5"},
                              {"SLURM_LOCALID", "0"},
                              {"SLURM_NODEID", "2"},
                              {"SLURM_TASKS_PER_NODE", "2(x2),1"},
                              {"SLURM_JOB_ID", "7"}});
  CHECK(uneven.local_world_size == 1);
  CHECK(uneven.node_rank == 2);
  const auto step_layout = detect({{"SLURM_PROCID", "1"},
                                   {"SLURM_NTASKS", "3"},
                                   {"SLURM_LOCALID", "1"},
                                   {"SLURM_NODEID", "0"},
                                   {"SLURM_STEP_TASKS_PER_NODE", "3"},
                                   {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                   {"SLURM_JOB_ID", "7"}});
  CHECK(step_layout.local_world_size == 3);  // the step's layout, not the allocation's
  CHECK(ddp::detail::slurm_tasks_on_node("2(x2),1", 0) == 2);
  CHECK(ddp::detail::slurm_tasks_on_node("2(x2),1", 1) == 2);
  CHECK(ddp::detail::slurm_tasks_on_node("2(x2),1", 2) == 1);
  CHECK(!ddp::detail::slurm_tasks_on_node("2(x2),1", 3));
  CHECK(!ddp::detail::slurm_tasks_on_node("2(x", 0));
  CHECK(!ddp::detail::slurm_tasks_on_node("x", 0));
  CHECK(!ddp::detail::slurm_tasks_on_node("", 0));
  CHECK(ddp::detail::first_slurm_host("node1,node2") == "node1");
  CHECK(ddp::detail::first_slurm_host("a[3,5-6],b") == "a3");

  const auto o = detect({{"OMPI_COMM_WORLD_RANK", "2"},
                         {"OMPI_COMM_WORLD_SIZE", "4"},
                         {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                         {"OMPI_COMM_WORLD_NODE_RANK", "0"},  // a rank within the node, not a node
                         {"SLURM_PROCID", "0"}});
  CHECK(o.launcher == "openmpi");  // mpirun inside an allocation: Open MPI's view wins
  CHECK(o.rank == 2);
  CHECK(o.local_world_size == 2);
  CHECK(o.node_rank == 1);
  CHECK(o.master_addr.empty());  // across hosts without MASTER_ADDR: rank 0's host is unknown

  const auto one_host = detect({{"OMPI_COMM_WORLD_RANK", "1"},
                                {"OMPI_COMM_WORLD_SIZE", "2"},
                                {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  CHECK(one_host.master_addr == "127.0.0.1");  // one host: rank 0 is here

  const auto p = detect({{"PMI_RANK", "1"},
                         {"PMI_SIZE", "3"},
                         {"MPI_LOCALRANKID", "1"},
                         {"MPI_LOCALNRANKS", "3"},
                         {"MASTER_PORT", "4000"}});
  CHECK(p.launcher == "pmi");
  CHECK(p.rank == 1);
  CHECK(p.world_size == 3);
  CHECK(p.local_rank == 1);
  CHECK(p.master_port == 4000);

  const auto m = detect({{"MV2_COMM_WORLD_RANK", "3"},
                         {"MV2_COMM_WORLD_SIZE", "4"},
                         {"MV2_COMM_WORLD_LOCAL_RANK", "1"},
                         {"MV2_COMM_WORLD_LOCAL_SIZE", "2"},
                         {"MASTER_ADDR", "n1"},
                         {"MASTER_PORT", "4100"}});
  CHECK(m.launcher == "mvapich");
  CHECK(m.rank == 3);
  CHECK(m.world_size == 4);
  CHECK(m.local_rank == 1);
  CHECK(m.local_world_size == 2);
  CHECK(m.node_rank == 1);
  CHECK(m.master_addr == "n1");
  CHECK(m.warning.empty());
}

TEST_CASE("environment: a launcher ddp cannot read is not silent") {
  for (const char* var : {"PMIX_RANK", "LOCAL_RANK"}) {
    const auto e = detect({{var, "2"}});
    CHECK(e.launcher == "unknown");  // not "none": the quickstart pattern does not fork a job
    CHECK(e.world_size == 1);
    CHECK(e.warning.find(var) != std::string::npos);
    CHECK(e.warning.find("rank 0 of a world of 1") != std::string::npos);
  }
  CHECK(detect({}).warning.empty());
  CHECK(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}}).warning.empty());
}

TEST_CASE("environment: malformed values are rejected, naming the variable") {
  CHECK(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "1"}})
            .find("RANK=4 must be less than WORLD_SIZE=4") != std::string::npos);
  CHECK(error_of({{"RANK", "abc"}, {"WORLD_SIZE", "4"}}).find("RANK=\"abc\" is not an integer") !=
        std::string::npos);
  CHECK(error_of({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}).find("RANK=-1 is out of range") !=
        std::string::npos);
  CHECK(error_of({{"RANK", "1"}, {"WORLD_SIZE", "2x"}}).find("WORLD_SIZE=\"2x\"") !=
        std::string::npos);
  CHECK(error_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}}).find("MASTER_PORT is not set") !=
        std::string::npos);
  CHECK(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}})
            .find("MASTER_PORT=70000") != std::string::npos);
  CHECK(error_of({{"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}).find("RANK is not") !=
        std::string::npos);
  CHECK(error_of({{"RANK", "0"},
                  {"WORLD_SIZE", "2"},
                  {"MASTER_PORT", "1"},
                  {"LOCAL_RANK", "2"},
                  {"LOCAL_WORLD_SIZE", "2"}})
            .find("LOCAL_RANK=2 must be less than LOCAL_WORLD_SIZE=2") != std::string::npos);
  CHECK(error_of({{"OMPI_COMM_WORLD_RANK", "9"}, {"OMPI_COMM_WORLD_SIZE", "2"}})
            .find("OMPI_COMM_WORLD_RANK=9") != std::string::npos);
  CHECK(error_of({{"SLURM_PROCID", "x"}}).find("SLURM_PROCID") != std::string::npos);
  // A world of one needs no master port.
  CHECK(detect({{"RANK", "0"}, {"WORLD_SIZE", "1"}}).world_size == 1);
}

TEST_CASE("DDP_TIMEOUT sets Options::timeout in seconds, a malformed value is named") {
  using std::chrono::milliseconds;
  const auto with = [](const char* value) {
    ::setenv("DDP_TIMEOUT", value, 1);
    const auto t = ddp::detail::EnvReader().seconds("DDP_TIMEOUT").value_or(milliseconds(7));
    ::unsetenv("DDP_TIMEOUT");
    return t;
  };
  ::unsetenv("DDP_TIMEOUT");
  CHECK(ddp::detail::EnvReader().seconds("DDP_TIMEOUT").value_or(milliseconds(7)) ==
        milliseconds(7));
  CHECK(ddp::Options{}.timeout == std::chrono::minutes(5));
  CHECK(with("0.5") == milliseconds(500));
  CHECK(with("300") == milliseconds(300000));
  CHECK(with("1e-3") == milliseconds(1));
  CHECK(with("2147483") == milliseconds(2147483000));
  ::setenv("DDP_TIMEOUT", "2.5", 1);
  CHECK(ddp::Options::from_env().timeout == milliseconds(2500));
  CHECK(ddp::Options{}.timeout == std::chrono::minutes(5));  // plain data: reads nothing
  CHECK(ddp::Options{.timeout = milliseconds(7)}.with_env().timeout == milliseconds(7));
  ::unsetenv("DDP_TIMEOUT");
  for (const char* bad : {"abc", "-1", "0", "0.0001", "2147484", "inf", "nan", "5s", " "}) {
    CAPTURE(std::string(bad));
    try {
      (void)with(bad);
      FAIL("accepted");
    } catch (const ddp::Error& e) {
      ::unsetenv("DDP_TIMEOUT");
      CHECK(e.code() == ddp::Errc::invalid_argument);
      CHECK(std::string(e.what()).find("DDP_TIMEOUT=\"" + std::string(bad) +
                                       "\" is not a timeout") != std::string::npos);
    }
  }
}

TEST_CASE("DDP_TRACE_ENTRIES and DDP_SEGMENT_BYTES: numbers in range, anything else named") {
  ::unsetenv("DDP_TRACE_ENTRIES");
  CHECK(ddp::Options::from_env().trace_entries == 2000);
  ::setenv("DDP_TRACE_ENTRIES", "0", 1);
  CHECK(ddp::Options::from_env().trace_entries == 0);
  ::setenv("DDP_TRACE_ENTRIES", "1000000", 1);
  CHECK(ddp::Options::from_env().trace_entries == 1000000);
  for (const char* bad : {"-1", "1000001", "abc", "10k", "+5", " 5", "18446744073709551616"}) {
    CAPTURE(std::string(bad));
    ::setenv("DDP_TRACE_ENTRIES", bad, 1);
    try {
      (void)ddp::Options::from_env().trace_entries;
      FAIL("accepted");
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::invalid_argument);
      CHECK(std::string(e.what()).find("DDP_TRACE_ENTRIES=\"" + std::string(bad) +
                                       "\" must be a number of records") != std::string::npos);
    }
  }
  ::unsetenv("DDP_TRACE_ENTRIES");
  // A size: "-1" once wrapped to 2^64 - 1 and was taken.
  ::setenv("DDP_SEGMENT_BYTES", "65536", 1);
  CHECK(ddp::detail::EnvReader().whole_number("DDP_SEGMENT_BYTES", 4096, 1ull << 40, "bytes") ==
        65536u);
  for (const char* bad : {"-1", "4095", "64KiB"}) {
    ::setenv("DDP_SEGMENT_BYTES", bad, 1);
    CHECK_THROWS_WITH_AS(
        (void)ddp::detail::EnvReader().whole_number("DDP_SEGMENT_BYTES", 4096, 1ull << 40, "bytes"),
        doctest::Contains("DDP_SEGMENT_BYTES=\""), ddp::Error);
  }
  ::unsetenv("DDP_SEGMENT_BYTES");
  CHECK(!ddp::detail::EnvReader()
             .whole_number("DDP_SEGMENT_BYTES", 4096, 1ull << 40, "bytes")
             .has_value());
  ::setenv("DDP_SEGMENT_BYTES", "65536", 1);
  CHECK(ddp::Options::from_env().segment_bytes == 65536u);
  CHECK(ddp::Options{.segment_bytes = 8192}.with_env().segment_bytes == 8192u);
  ::unsetenv("DDP_SEGMENT_BYTES");
}

TEST_CASE("DDP_SHM_SINGLE_COPY: a number of bytes or off, anything else named") {
  ::unsetenv("DDP_SHM_SINGLE_COPY");
  CHECK(ddp::Options::from_env().shm_single_copy_bytes == 0u);  // the default
  ::setenv("DDP_SHM_SINGLE_COPY", "4096", 1);
  CHECK(ddp::Options::from_env().shm_single_copy_bytes == 4096u);
  ::setenv("DDP_SHM_SINGLE_COPY", "auto", 1);
  CHECK(ddp::Options::from_env().shm_single_copy_bytes == 0u);
  ::setenv("DDP_SHM_SINGLE_COPY", "off", 1);
  CHECK(ddp::Options::from_env().shm_single_copy_bytes == ddp::Options::never);
  CHECK(ddp::Options{.shm_single_copy_bytes = 8192}.with_env().shm_single_copy_bytes == 8192u);
  for (const char* bad : {"0", "-1", "Off", "64K", "1099511627777"}) {
    CAPTURE(std::string(bad));
    ::setenv("DDP_SHM_SINGLE_COPY", bad, 1);
    try {
      (void)ddp::Options::from_env();
      FAIL("accepted");
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::invalid_argument);
      CHECK(std::string(e.what()).find("DDP_SHM_SINGLE_COPY=\"" + std::string(bad) + "\"") !=
            std::string::npos);
    }
  }
  ::unsetenv("DDP_SHM_SINGLE_COPY");
}

TEST_CASE(
    "Options::with_env reads through any lookup, and only into fields left at their default") {
  const std::map<std::string, std::string> vars = {
      {"DDP_TIMEOUT", "3"},          {"DDP_TOKEN", "s3cret"},
      {"DDP_HOST_TRANSPORT", "tcp"}, {"DDP_VERIFY_COLLECTIVES", "off"},
      {"DDP_TRACE_ENTRIES", "7"},    {"DDP_TRACE_DUMP", "stderr"}};
  const ddp::detail::EnvReader env([&](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  });
  const auto o = ddp::Options::from_env(env);
  CHECK(o.timeout == std::chrono::seconds(3));
  CHECK(o.token == "s3cret");
  CHECK(o.transport == ddp::HostTransport::tcp);
  CHECK_FALSE(o.verify_collectives);
  CHECK(o.trace_entries == 7);
  CHECK(o.trace_dump == "stderr");
  ddp::Options mine;
  mine.token = "mine";
  mine.transport = ddp::HostTransport::shm;
  mine.trace_dump = "/tmp";
  const auto m = mine.with_env(env);
  CHECK(m.token == "mine");
  CHECK(m.transport == ddp::HostTransport::shm);
  CHECK(m.trace_dump == "/tmp");
  CHECK(m.timeout == std::chrono::seconds(3));
  const ddp::detail::EnvReader bad([](const char* name) -> const char* {
    return std::string_view(name) == "DDP_HOST_TRANSPORT" ? "carrier-pigeon" : nullptr;
  });
  CHECK_THROWS_WITH_AS(
      (void)ddp::Options::from_env(bad),
      doctest::Contains("DDP_HOST_TRANSPORT=\"carrier-pigeon\": use shm, tcp or auto"), ddp::Error);
}
