// Logger and Progress: whole lines on rank 0 or every rank, a progress line per quarter in a log,
// one line redrawn on a terminal.
#include <ddp/observe/logging.hpp>

#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <termios.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <string>

namespace {
/// What was written to a temporary file through `fd`.
std::string written(int fd) {
  std::string out(4096, '\0');
  const ssize_t n = ::pread(fd, out.data(), out.size(), 0);
  out.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  return out;
}
}  // namespace

TEST_CASE("training: Logger prints whole lines on rank 0 or on every rank with its prefix") {
  char path[] = "/tmp/ddp-log-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::unlink(path);
  ddp::Logger(1, {.fd = fd}).print("rank %d says %s", 1, "nothing");
  ddp::Logger(0, {.fd = fd}).print("epoch %d: %s", 3, "loss 0.25");
  ddp::Logger(2, {.every_rank = true, .fd = fd}).print("%s", "mine");
  ddp::Logger(0, {.fd = fd}).print("%s", std::string(300, 'x').c_str());  // past the small buffer
  CHECK(written(fd) == "epoch 3: loss 0.25\n[r2] mine\n" + std::string(300, 'x') + "\n");
  CHECK(!ddp::Logger(0, {.fd = fd}).terminal());
  CHECK(!ddp::Logger(1).enabled());
  ::close(fd);
}

TEST_CASE("training: under ddprun's [rRANK] prefix a Logger adds only a rank changed since") {
  char path[] = "/tmp/ddp-log-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::unlink(path);
  ::setenv("DDP_OUTPUT_PREFIXED", "1", 1);
  ::setenv("RANK", "2", 1);
  ddp::Logger(2, {.every_rank = true, .fd = fd}).print("%s", "as started");
  ddp::Logger(1, {.every_rank = true, .fd = fd}).print("%s", "shrunk");  // rank 2 is now rank 1
  ::setenv("RANK", "two", 1);  // not a rank: the logger's own prefix
  ddp::Logger(1, {.every_rank = true, .fd = fd}).print("%s", "own");
  ::unsetenv("DDP_OUTPUT_PREFIXED");
  ::unsetenv("RANK");
  CHECK(written(fd) == "as started\n(now r1) shrunk\n[r1] own\n");
  ::close(fd);
}

TEST_CASE("training: Progress writes a line per quarter in a log, redraws on a terminal") {
  char path[] = "/tmp/ddp-log-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::unlink(path);
  const ddp::Logger log(0, {.fd = fd});
  {
    ddp::Progress bar(log, "epoch 1/2", 1000, 4);
    for (std::size_t done = 10; done <= 1000; done += 10) bar.update(done, {{"loss", 0.5}});
    bar.finish();
  }
  const std::string out = written(fd);
  CAPTURE(out);
  CHECK(std::count(out.begin(), out.end(), '\n') == 4);
  CHECK(out.find('\r') == std::string::npos);
  for (const char* pct : {" 25%", " 50%", " 75%", "100%"})
    CHECK(out.find(pct) != std::string::npos);
  CHECK(out.rfind("epoch 1/2 [#####               ]  25%  ", 0) == 0);
  CHECK(out.find("samples/s  loss 0.5\n") != std::string::npos);
  // Stopped early: the final line says where.
  REQUIRE(::ftruncate(fd, 0) == 0);
  ::lseek(fd, 0, SEEK_SET);
  { ddp::Progress(log, "short", 1000).update(100); }
  CHECK(written(fd).find("short [##                  ]  10%") == 0);
  ::close(fd);
  // A terminal: one line redrawn with carriage returns, ended by finish().
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY);
  REQUIRE(master >= 0);
  REQUIRE(::grantpt(master) == 0);
  REQUIRE(::unlockpt(master) == 0);
  const int tty = ::open(::ptsname(master), O_RDWR | O_NOCTTY);
  REQUIRE(tty >= 0);
  termios raw{};
  ::tcgetattr(tty, &raw);
  ::cfmakeraw(&raw);
  ::tcsetattr(tty, TCSANOW, &raw);
  const ddp::Logger term(0, {.fd = tty});
  CHECK(term.terminal());
  {
    ddp::Progress bar(term, "tty", 100);
    bar.update(100);
    bar.finish();
  }
  std::string drawn;  // what the terminal shows, read until the line ends (writes may arrive apart)
  for (int tries = 0; tries < 200 && drawn.find('\n') == std::string::npos; ++tries) {
    pollfd pfd{master, POLLIN, 0};
    if (::poll(&pfd, 1, 10) != 1) continue;
    char buf[512];
    const ssize_t n = ::read(master, buf, sizeof buf);
    if (n > 0) drawn.append(buf, static_cast<std::size_t>(n));
  }
  CAPTURE(drawn);
  CHECK(drawn.rfind("\rtty [####################] 100%", 0) == 0);
  CHECK(drawn.back() == '\n');
  ::close(tty);
  ::close(master);
}
