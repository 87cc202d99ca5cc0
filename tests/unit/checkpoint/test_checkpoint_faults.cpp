// Checkpoints under faults, across real processes: an I/O error (EIO, ENOSPC) or a SIGKILL at
// every file operation of a save, on every rank, must leave a complete checkpoint to load (the
// previous one or the new one) and nothing that a later save does not clean up; links, FIFOs and
// directories at the checkpoint path are refused, never written through or waited on.
//
// Faults that cannot be made for real on demand (EIO from fsync, a kill between two given system
// calls) are injected by this executable's own definitions of open, write, fsync, rename and
// unlink, which count the calls on files under a test directory and fail or kill at the chosen
// one; every other call goes straight to the C library.
#include <ddp/checkpoint/async_checkpoint.hpp>
#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/training/zero/sharded_checkpoint.hpp>

#include "multiprocess.hpp"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

namespace fault {

enum class Action { none, count, eio, enospc, kill };

/// The plan of this process (each forked rank sets its own): act on the at-th call touching a
/// file under `dir`.
struct Plan {
  std::string dir;
  Action action = Action::none;
  int at = 0;
  int seen = 0;
};
Plan plan;

bool under_dir(const char* path) {
  return plan.action != Action::none && path != nullptr && !plan.dir.empty() &&
         std::strncmp(path, plan.dir.c_str(), plan.dir.size()) == 0;
}

bool fd_under_dir(int fd) {
  if (plan.action == Action::none) return false;
  char link[64], target[4096] = {};
  std::snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  const ssize_t n = ::readlink(link, target, sizeof target - 1);
  return n > 0 && under_dir(target);
}

/// Whether this call fails (errno set); kills the process when the plan says so.
bool strike(bool touches) {
  if (!touches) return false;
  ++plan.seen;
  if (plan.action == Action::count || plan.seen != plan.at) return false;
  switch (plan.action) {
    case Action::kill: ::raise(SIGKILL); return false;
    case Action::eio: errno = EIO; return true;
    case Action::enospc: errno = ENOSPC; return true;
    default: return false;
  }
}

template <class F>
F real(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

}  // namespace fault

extern "C" {
int open(const char* path, int flags, ...) {  // NOLINT(cert-dcl50-cpp): the C library's shape
  mode_t mode = 0;
  if ((flags & O_CREAT) != 0 || (flags & O_TMPFILE) == O_TMPFILE) {
    va_list ap;
    va_start(ap, flags);
    mode = static_cast<mode_t>(va_arg(ap, unsigned));
    va_end(ap);
  }
  if (fault::strike(fault::under_dir(path))) return -1;
  static const auto f = fault::real<int (*)(const char*, int, ...)>("open");
  return f(path, flags, mode);
}
ssize_t write(int fd, const void* data, size_t n) {
  if (fault::strike(fault::fd_under_dir(fd))) return -1;
  static const auto f = fault::real<ssize_t (*)(int, const void*, size_t)>("write");
  return f(fd, data, n);
}
int fsync(int fd) {
  if (fault::strike(fault::fd_under_dir(fd))) return -1;
  static const auto f = fault::real<int (*)(int)>("fsync");
  return f(fd);
}
int rename(const char* from, const char* to) {
  if (fault::strike(fault::under_dir(from))) return -1;
  static const auto f = fault::real<int (*)(const char*, const char*)>("rename");
  return f(from, to);
}
int unlink(const char* path) {
  if (fault::strike(fault::under_dir(path))) return -1;
  static const auto f = fault::real<int (*)(const char*)>("unlink");
  return f(path);
}
}

namespace {

using mp::Comm;

/// The names in `dir`, sorted.
std::vector<std::string> listing(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

/// Runs body on `world` ranks; a rank that is killed or throws does not stop the others.
void run_all(int world, const std::function<void(Comm&)>& body) {
  ddp::SpawnOptions so;
  so.stop_on_failure = false;
  so.end_left_out = false;  // fault tests wake the ranks they fence
  ddp::Options o;
  o.transport = ddp::HostTransport::shm;
  o.timeout = std::chrono::seconds(20);
  try {
    ddp::spawn(
        world,
        [&](ddp::Environment env) {
          auto comm = Comm::init(env, o);
          body(comm);
        },
        so);
  } catch (const ddp::Error&) {
  }
}

ddp::Checkpoint step_checkpoint(int step, int rank) {
  ddp::Checkpoint ck;
  ck.put_object("step", step);
  ck.put_object("rank", rank);
  ck.put_values("data", std::vector<float>(20000, static_cast<float>(step)));  // 80 KB
  return ck;
}

/// Every rank loads the sharded checkpoint at `path`: it must be there, whole, of one step on
/// every rank; returns that step (written to `out` by rank 0).
void load_agreed(Comm& comm, const std::string& path, const std::string& out) {
  const auto ck = ddp::load_sharded_checkpoint(comm, path);
  MP_EXPECT(ck.has_value(), "no checkpoint to load");
  const int step = ck->get_object<int>("step");
  MP_EXPECT(ck->get_object<int>("rank") == comm.rank(), "another rank's shard");
  std::vector<float> data(20000);
  ck->get_values("data", std::span(data));
  MP_EXPECT(data.front() == static_cast<float>(step) && data.back() == static_cast<float>(step),
            "data of another step");
  const auto steps = comm.all_gather_object(step);
  for (const int s : steps) MP_EXPECT(s == step, "ranks loaded different steps");
  if (comm.rank() == 0) mp::TempDir::write(out, std::to_string(step));
}

}  // namespace

TEST_CASE("sharded checkpoint: an I/O error or a kill at every step of a save, on every rank") {
  constexpr int world = 2;
  // How many file operations a save makes on each rank.
  std::vector<int> ops(world);
  {
    mp::TempDir dir;
    const std::string path = dir.file("run");
    run_all(world, [&](Comm& comm) {
      (void)ddp::save_sharded_checkpoint(comm, step_checkpoint(1, comm.rank()), path);
      fault::plan = {dir.path, fault::Action::count, 0, 0};
      (void)ddp::save_sharded_checkpoint(comm, step_checkpoint(2, comm.rank()), path);
      const int seen = fault::plan.seen;
      fault::plan = {};
      mp::TempDir::write(dir.file("ops" + std::to_string(comm.rank())), std::to_string(seen));
    });
    for (int r = 0; r < world; ++r) {
      ops[static_cast<std::size_t>(r)] =
          std::stoi("0" + mp::TempDir::read(dir.file("ops" + std::to_string(r))));
      CHECK(ops[static_cast<std::size_t>(r)] >= 5);  // create, write, flush, rename, unlink, ...
    }
    MESSAGE("file operations of a save: rank 0 " << ops[0] << ", rank 1 " << ops[1]);
  }
  // The same save made by AsyncShardedSaver (the rank's file written by a thread of its own,
  // the save completed by wait()): the same file operations, the same guarantees (an I/O error
  // and a kill: ENOSPC takes the path of EIO).
  for (const bool async : {false, true}) {
    for (const fault::Action action :
         {fault::Action::eio, fault::Action::enospc, fault::Action::kill}) {
      if (async && action == fault::Action::enospc) continue;
      for (int victim = 0; victim < world; ++victim) {
        for (int at = 1; at <= ops[static_cast<std::size_t>(victim)]; ++at) {
          CAPTURE(async);
          CAPTURE(static_cast<int>(action));
          CAPTURE(victim);
          CAPTURE(at);
          mp::TempDir dir;
          const std::string path = dir.file("run");
          run_all(world, [&](Comm& comm) {
            (void)ddp::save_sharded_checkpoint(comm, step_checkpoint(1, comm.rank()), path);
            if (comm.rank() == victim) fault::plan = {dir.path, action, at, 0};
            std::string outcome = "ok";
            try {
              if (async) {
                ddp::AsyncShardedSaver saver;
                (void)saver.save(comm, step_checkpoint(2, comm.rank()), path);  // returns at once
                saver.wait(comm);  // the outcome of every rank's write
              } else {
                (void)ddp::save_sharded_checkpoint(comm, step_checkpoint(2, comm.rank()), path);
              }
            } catch (const ddp::Error& e) {
              outcome = std::string(ddp::to_string(e.code())) + " " + e.what();
            }
            fault::plan = {};
            mp::TempDir::write(dir.file("outcome" + std::to_string(comm.rank())), outcome);
          });
          std::vector<std::string> outcomes;
          for (int r = 0; r < world; ++r)
            outcomes.push_back(mp::TempDir::read(dir.file("outcome" + std::to_string(r))));
          CAPTURE(joined(outcomes));
          const auto after_fault = listing(dir.path);
          CAPTURE(joined(after_fault));
          // A failure every rank heard of (no kill) leaves exactly the previous set: no new
          // generation, no temporary file.
          bool all_failed = action != fault::Action::kill;
          for (const auto& o : outcomes) all_failed = all_failed && o.rfind("ok", 0) != 0;
          if (all_failed) {
            for (const auto& name : after_fault) {
              CAPTURE(name);
              CHECK(name.find(".tmp.") == std::string::npos);
              if (name.rfind("run.rank", 0) == 0) CHECK(name.find("-of-2.1.") != std::string::npos);
            }
          }
          // In new processes: a complete checkpoint loads, the same step on every rank: the
          // previous one when the save failed everywhere, else either.
          mp::run(world, ddp::HostTransport::shm,
                  [&](Comm& comm) { load_agreed(comm, path, dir.file("loaded")); });
          const std::string loaded = mp::TempDir::read(dir.file("loaded"));
          CHECK((loaded == "1" || loaded == "2"));
          if (all_failed) CHECK(loaded == "1");
          bool all_ok = true;
          for (const auto& o : outcomes) all_ok = all_ok && o == "ok";
          if (all_ok) CHECK(loaded == "2");
          // The next save succeeds and cleans up: one file per rank, no temporary.
          mp::run(world, ddp::HostTransport::shm, [&](Comm& comm) {
            (void)ddp::save_sharded_checkpoint(comm, step_checkpoint(3, comm.rank()), path);
            load_agreed(comm, path, dir.file("loaded"));
          });
          CHECK(mp::TempDir::read(dir.file("loaded")) == "3");
          int shard_files = 0, temporaries = 0;
          for (const auto& name : listing(dir.path)) {
            shard_files +=
                name.rfind("run.rank", 0) == 0 && name.find(".tmp.") == std::string::npos;
            temporaries += name.find(".tmp.") != std::string::npos;
          }
          CAPTURE(joined(listing(dir.path)));
          CHECK(shard_files == world);
          CHECK(temporaries == 0);
        }
      }
    }
  }
}

TEST_CASE("checkpoint: an I/O error or a kill at every step of a save leaves the old or the new") {
  int ops = 0;
  {
    mp::TempDir dir;
    const std::string path = dir.file("run.ckpt");
    run_all(2, [&](Comm& comm) {
      ddp::save_checkpoint(comm, step_checkpoint(1, 0), path);
      if (comm.rank() == 0) fault::plan = {dir.path, fault::Action::count, 0, 0};
      ddp::save_checkpoint(comm, step_checkpoint(2, 0), path);
      if (comm.rank() == 0) mp::TempDir::write(dir.file("ops"), std::to_string(fault::plan.seen));
      fault::plan = {};
    });
    ops = std::stoi("0" + mp::TempDir::read(dir.file("ops")));
    CHECK(ops >= 4);
    MESSAGE("file operations of a save: " << ops);
  }
  for (const fault::Action action : {fault::Action::eio, fault::Action::kill}) {
    for (int at = 1; at <= ops; ++at) {
      CAPTURE(static_cast<int>(action));
      CAPTURE(at);
      mp::TempDir dir;
      const std::string path = dir.file("run.ckpt");
      run_all(2, [&](Comm& comm) {
        ddp::save_checkpoint(comm, step_checkpoint(1, 0), path);
        if (comm.rank() == 0) fault::plan = {dir.path, action, at, 0};
        std::string outcome = "ok";
        try {
          ddp::save_checkpoint(comm, step_checkpoint(2, 0), path);
        } catch (const ddp::Error& e) {
          outcome = std::string(ddp::to_string(e.code())) + " " + e.what();
        }
        fault::plan = {};
        mp::TempDir::write(dir.file("outcome" + std::to_string(comm.rank())), outcome);
      });
      // The survivor heard of the failure (or of the loss of rank 0), named.
      const std::string survivor = mp::TempDir::read(dir.file("outcome1"));
      CAPTURE(survivor);
      CHECK((survivor == "ok" || survivor.rfind("system rank 1: save_checkpoint: rank 0", 0) == 0 ||
             survivor.rfind("peer_lost", 0) == 0));
      mp::run(2, ddp::HostTransport::shm, [&](Comm& comm) {
        const auto ck = ddp::load_checkpoint(comm, path);
        MP_EXPECT(ck.has_value(), "the checkpoint is gone");
        if (comm.rank() == 0)
          mp::TempDir::write(dir.file("loaded"), std::to_string(ck->get_object<int>("step")));
        ddp::save_checkpoint(comm, step_checkpoint(3, 0), path);
      });
      const std::string loaded = mp::TempDir::read(dir.file("loaded"));
      CHECK((loaded == "1" || loaded == "2"));
      CAPTURE(joined(listing(dir.path)));
      for (const auto& name : listing(dir.path)) CHECK(name.find(".tmp.") == std::string::npos);
      CHECK(ddp::Checkpoint::load(path)->get_object<int>("step") == 3);
    }
  }
}

TEST_CASE("checkpoint: links, FIFOs and directories at the path are refused, never followed") {
  mp::TempDir dir;
  const std::string path = dir.file("run.ckpt"), victim = dir.file("victim");
  mp::TempDir::write(victim, "precious");
  const auto ck = step_checkpoint(1, 0);
  // Links planted under every name a temporary file could have had (the process id alone) are
  // not written through: the new names are unpredictable and created exclusively.
  for (int pid = ::getpid(); pid < ::getpid() + 3; ++pid)
    ::symlink(victim.c_str(), (path + ".tmp." + std::to_string(pid)).c_str());
  ck.save(path);
  CHECK(mp::TempDir::read(victim) == "precious");
  struct stat st {};
  REQUIRE(::lstat(path.c_str(), &st) == 0);
  CHECK(S_ISREG(st.st_mode));
  // Something other than a regular file at the checkpoint path: refused, left as it is.
  const auto refused = [&](const std::string& at, const char* kind) {
    CAPTURE(kind);
    try {
      ck.save(at);
      FAIL("saved over " << std::string(kind));
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::invalid_argument);
      CHECK(std::string(e.what()).find(kind) != std::string::npos);
      CHECK(std::string(e.what()).find(at) != std::string::npos);
    }
  };
  const std::string link = dir.file("link.ckpt"), fifo = dir.file("fifo.ckpt"),
                    sub = dir.file("dir.ckpt");
  REQUIRE(::symlink(victim.c_str(), link.c_str()) == 0);
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  REQUIRE(::mkdir(sub.c_str(), 0755) == 0);
  refused(link, "a symbolic link");
  refused(fifo, "a FIFO");
  refused(sub, "a directory");
  CHECK(mp::TempDir::read(victim) == "precious");
  REQUIRE(::lstat(link.c_str(), &st) == 0);
  CHECK(S_ISLNK(st.st_mode));
  // No temporary file is left, and the planted links are left alone (not ddp's to remove).
  for (const auto& name : listing(dir.path)) {
    if (name.find(".tmp.") == std::string::npos) continue;
    CAPTURE(name);
    CHECK(::lstat(dir.file(name).c_str(), &st) == 0);
    CHECK(S_ISLNK(st.st_mode));
  }
  // Loading a FIFO fails at once on every rank instead of blocking rank 0 in open().
  mp::run(2, ddp::HostTransport::shm, [&](Comm& comm) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      (void)ddp::load_checkpoint(comm, fifo);
      MP_EXPECT(false, "a FIFO was loaded");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::invalid_argument, e.what());
      MP_EXPECT(std::string(e.what()).find("a FIFO") != std::string::npos, e.what());
    }
    MP_EXPECT(mp::ms_since(t0) < 10000, "took " << mp::ms_since(t0) << " ms");
    mp::TempDir::write(dir.file("fifo-loaded" + std::to_string(comm.rank())), "refused");
  });
  CHECK(mp::TempDir::read(dir.file("fifo-loaded0")) == "refused");
  CHECK(mp::TempDir::read(dir.file("fifo-loaded1")) == "refused");
  // A link to a regular checkpoint is read through (loading cannot harm what it points to).
  const std::string alias = dir.file("alias.ckpt");
  REQUIRE(::symlink(path.c_str(), alias.c_str()) == 0);
  CHECK(ddp::Checkpoint::load(alias)->get_object<int>("step") == 1);
  // Sharded: FIFOs and links among the generations are not generations.
  mp::run(2, ddp::HostTransport::shm, [&](Comm& comm) {
    const std::string s = dir.file("s");
    (void)ddp::save_sharded_checkpoint(comm, step_checkpoint(4, comm.rank()), s);
    const std::string stem = ddp::shard_path(s, comm.rank(), 2);
    ::mkfifo((stem + ".99.0123456789abcdef").c_str(), 0600);
    ::symlink(victim.c_str(), (stem + ".98.0123456789abcdef").c_str());
    load_agreed(comm, s, dir.file("sharded-loaded"));
  });
  CHECK(mp::TempDir::read(dir.file("sharded-loaded")) == "4");
}

TEST_CASE("checkpoint: temporaries of killed saves are removed by the next save, live ones kept") {
  mp::TempDir dir;
  const std::string path = dir.file("run.ckpt");
  const pid_t dead = ::fork();
  if (dead == 0) ::_exit(0);
  ::waitpid(dead, nullptr, 0);
  const std::string old_style = path + ".tmp." + std::to_string(dead);
  const std::string new_style = path + ".tmp." + std::to_string(dead) + ".0123456789abcdef";
  const std::string live = path + ".tmp." + std::to_string(::getpid()) + ".0123456789abcdef";
  for (const auto& f : {old_style, new_style, live}) mp::TempDir::write(f, "half a checkpoint");
  step_checkpoint(1, 0).save(path);
  CHECK(!std::filesystem::exists(old_style));
  CHECK(!std::filesystem::exists(new_style));
  CHECK(std::filesystem::exists(live));  // its process runs: it may still be saving
}

TEST_CASE("checkpoint: a killed save's temporary goes even while its process is a zombie") {
  mp::TempDir dir;
  const std::string path = dir.file("run.ckpt");
  const pid_t saver = ::fork();
  if (saver == 0) {
    (void)ddp::Checkpoint::stage_bytes(path, std::string(1 << 20, 'x'));  // staged, never committed
    ::pause();
    ::_exit(0);
  }
  for (int i = 0; i < 500 && listing(dir.path).empty(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ::kill(saver, SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // dead, not reaped: a zombie
  step_checkpoint(1, 0).save(path);
  CAPTURE(joined(listing(dir.path)));
  for (const auto& name : listing(dir.path)) CHECK(name.find(".tmp.") == std::string::npos);
  ::waitpid(saver, nullptr, 0);
}

TEST_CASE("sharded checkpoint: two jobs saving to one path, both killed, still load") {
  // Misuse, but it must not cost the checkpoint: each save's files carry its own id, so the
  // jobs' generations never mix, and a save removes only generations older than its own.
  for (int round = 0; round < 6; ++round) {
    CAPTURE(round);
    mp::TempDir dir;
    const std::string path = dir.file("s");
    mp::run(2, ddp::HostTransport::shm, [&](Comm& comm) {
      (void)ddp::save_sharded_checkpoint(comm, step_checkpoint(1, comm.rank()), path);
    });
    std::vector<pid_t> jobs;
    for (int job = 0; job < 2; ++job) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::setpgid(0, 0);
        (void)mp::spawn_all(2, [&](ddp::Environment env) {
          ddp::Options o;
          o.transport = ddp::HostTransport::shm;
          o.group = "job" + std::to_string(job);
          auto comm = Comm::init(env, o);
          for (int step = 2;; ++step)
            (void)ddp::save_sharded_checkpoint(comm, step_checkpoint(step, comm.rank()), path);
        });
        ::_exit(0);
      }
      jobs.push_back(pid);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(150 + 60 * round));
    for (const pid_t pid : jobs) ::kill(-pid, SIGKILL);
    for (const pid_t pid : jobs) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the ranks' exits
    mp::run(2, ddp::HostTransport::shm,
            [&](Comm& comm) { load_agreed(comm, path, dir.file("loaded")); });
    CHECK(std::stoi("0" + mp::TempDir::read(dir.file("loaded"))) >= 1);
  }
}

TEST_CASE("async checkpoint: an I/O error or a kill at every step of the background write") {
  // How many file operations the background write makes (counted in a child: the plan is global).
  int ops = 0;
  {
    mp::TempDir dir;
    const std::string path = dir.file("run.ckpt");
    const pid_t child = ::fork();
    if (child == 0) {
      step_checkpoint(1, 0).save(path);
      fault::plan = {dir.path, fault::Action::count, 0, 0};
      ddp::AsyncSaver saver;
      saver.save(step_checkpoint(2, 0), path);
      saver.wait();
      mp::TempDir::write(dir.file("ops"), std::to_string(fault::plan.seen));
      ::_exit(0);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    REQUIRE(WIFEXITED(status));
    ops = std::stoi("0" + mp::TempDir::read(dir.file("ops")));
    CHECK(ops >= 4);
  }
  for (const fault::Action action :
       {fault::Action::eio, fault::Action::enospc, fault::Action::kill}) {
    for (int at = 1; at <= ops; ++at) {
      CAPTURE(static_cast<int>(action));
      CAPTURE(at);
      mp::TempDir dir;
      const std::string path = dir.file("run.ckpt");
      const pid_t child = ::fork();
      if (child == 0) {
        step_checkpoint(1, 0).save(path);
        fault::plan = {dir.path, action, at, 0};
        ddp::AsyncSaver saver;
        saver.save(step_checkpoint(2, 0), path);  // returns before the write
        std::string outcome = "ok";
        try {
          saver.wait();  // the write's error surfaces here
        } catch (const ddp::Error& e) {
          outcome = std::string(ddp::to_string(e.code())) + " " + e.what();
        }
        fault::plan = {};
        mp::TempDir::write(dir.file("outcome"), outcome);
        ::_exit(0);
      }
      int status = 0;
      ::waitpid(child, &status, 0);
      if (action == fault::Action::kill) {
        CHECK((WIFSIGNALED(status) || WIFEXITED(status)));
      } else {
        const std::string outcome = mp::TempDir::read(dir.file("outcome"));
        CAPTURE(outcome);
        CHECK((outcome == "ok" || outcome.rfind("system Checkpoint: ", 0) == 0));
      }
      // The old checkpoint or the new one, complete; the next save cleans up.
      const auto ck = ddp::Checkpoint::load(path);
      REQUIRE(ck.has_value());
      const int step = ck->get_object<int>("step");
      CHECK((step == 1 || step == 2));
      ddp::AsyncSaver saver;
      saver.save(step_checkpoint(3, 0), path);
      saver.wait();
      CAPTURE(joined(listing(dir.path)));
      for (const auto& name : listing(dir.path)) CHECK(name.find(".tmp.") == std::string::npos);
      CHECK(ddp::Checkpoint::load(path)->get_object<int>("step") == 3);
    }
  }
}

TEST_CASE("async checkpoint: SIGKILL from outside during a 64 MB background write") {
  // A process saves 64 MB checkpoints one after another in the background, each holding one
  // value everywhere; killed at moments spread over the writes, it leaves a complete checkpoint.
  for (const int delay_ms : {5, 40, 90, 160, 300}) {
    CAPTURE(delay_ms);
    mp::TempDir dir;
    const std::string path = dir.file("big.ckpt");
    const pid_t child = ::fork();
    if (child == 0) {
      ddp::AsyncSaver saver;
      std::vector<float> w(std::size_t{16} << 20);
      for (int version = 1;; ++version) {
        std::fill(w.begin(), w.end(), static_cast<float>(version));
        ddp::Checkpoint ck;
        ck.put_values("w", w);
        ck.put_object("version", version);
        saver.save(std::move(ck), path);  // waits for the previous write first
      }
    }
    // Kill it `delay_ms` after the first complete checkpoint appeared.
    for (int i = 0; i < 3000 && !std::filesystem::exists(path); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
    const auto ck = ddp::Checkpoint::load(path);
    REQUIRE(ck.has_value());
    const int version = ck->get_object<int>("version");
    CHECK(version >= 1);
    std::vector<float> w(std::size_t{16} << 20);
    ck->get_values("w", std::span(w));
    CHECK(
        std::all_of(w.begin(), w.end(), [&](float x) { return x == static_cast<float>(version); }));
    step_checkpoint(1, 0).save(path);  // and the next save removes the killed one's temporary
    for (const auto& name : listing(dir.path)) CHECK(name.find(".tmp.") == std::string::npos);
  }
}
