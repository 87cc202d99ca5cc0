// Checkpoints: a run resumed mid-epoch ends bitwise as an uninterrupted one, files written
// atomically and refused when foreign or damaged, load_checkpoint and save_checkpoint across real
// processes. (Failed writes and killed savers: test_checkpoint_faults.cpp.)
#include <ddp/checkpoint/async_checkpoint.hpp>
#include <ddp/checkpoint/checkpoint.hpp>
#include <ddp/data/partition.hpp>
#include <ddp/training/averaging/gradient.hpp>

#include <doctest/doctest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "multiprocess.hpp"

// Named, so that the executable can be built as one unity translation unit.
namespace checkpoint_tests {

namespace {
/// A parameter: its values and its gradient.
struct Param {
  std::vector<float> value, grad;
};
/// A run of SGD with momentum over a shuffled, sharded dataset: `stop_after` steps then a
/// checkpoint at `path` (or to the end, -1), resuming from `path` when it exists. Returns the
/// final parameters' bytes (or "" when it stopped).
std::string train_with_checkpoints(mp::Comm& comm, const std::string& path, int stop_after) {
  constexpr std::size_t samples = 203, per_step = 5;
  constexpr int epochs = 3;
  std::vector<Param> model{{std::vector<float>(6, 0.1f), std::vector<float>(6)},
                           {std::vector<float>(1, 0.0f), std::vector<float>(1)}};
  std::vector<float> momentum(7, 0.0f);
  ddp::GradientAverager avg(comm, model);
  ddp::DistributedSampler sampler(samples, comm.size(), comm.rank(), {.shuffle = true, .seed = 11});
  int epoch = 0, step = 0;
  bool resumed = false;
  if (auto ck = ddp::load_checkpoint(comm, path)) {
    ck->get_values("w", std::span(model[0].value));
    ck->get_values("b", std::span(model[1].value));
    ck->get_values("momentum", std::span(momentum));
    step = ck->get_object<int>("step");
    const auto state = ck->get_object<ddp::SamplerState>("sampler");
    epoch = static_cast<int>(state.epoch);
    sampler.restore(state);
    resumed = true;
  }
  for (; epoch < epochs; ++epoch) {
    if (!resumed) sampler.set_epoch(static_cast<std::uint64_t>(epoch));
    resumed = false;
    const auto mine = sampler.indices();
    for (std::size_t first = 0; first < mine.size(); first += per_step) {
      const std::size_t n = std::min(per_step, mine.size() - first);
      for (auto& p : model) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
      for (std::size_t k = first; k < first + n; ++k) {  // squared error of a linear model
        const auto s = static_cast<float>(mine[k]);
        float pred = model[1].value[0];
        for (std::size_t j = 0; j < 6; ++j)
          pred += model[0].value[j] * std::sin(s * static_cast<float>(j + 1));
        const float err = pred - std::cos(s);
        for (std::size_t j = 0; j < 6; ++j)
          model[0].grad[j] += err * std::sin(s * static_cast<float>(j + 1));
        model[1].grad[0] += err;
      }
      avg.average();
      for (std::size_t j = 0; j < 7; ++j) {
        float& g = j < 6 ? model[0].grad[j] : model[1].grad[0];
        float& v = j < 6 ? model[0].value[j] : model[1].value[0];
        momentum[j] = 0.9f * momentum[j] + g;
        v -= 0.01f * momentum[j];
      }
      if (++step == stop_after) {
        ddp::Checkpoint ck;
        ck.put_values("w", model[0].value);
        ck.put_values("b", model[1].value);
        ck.put_values("momentum", momentum);
        ck.put_object("step", step);
        ck.put_object("sampler", sampler.state(first + n));
        ddp::save_checkpoint(comm, ck, path);
        return "";
      }
    }
  }
  std::string out;
  for (const auto& p : model)
    out.append(reinterpret_cast<const char*>(p.value.data()), p.value.size() * sizeof(float));
  return out;
}
}  // namespace

TEST_CASE(
    "training: a run resumed from a checkpoint mid-epoch ends bitwise as an uninterrupted one") {
  for (int world : {1, 2, 3}) {
    for (int stop_after : {7, 21, 40}) {  // in the first, second or third epoch by world
      CAPTURE(world);
      CAPTURE(stop_after);
      mp::TempDir dir;
      const std::string ckpt = dir.file("run.ckpt");
      mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {
        const std::string whole = train_with_checkpoints(comm, dir.file("none.ckpt"), -1);
        if (comm.rank() == 0) mp::TempDir::write(dir.file("whole"), whole);
      });
      mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {
        MP_EXPECT(train_with_checkpoints(comm, ckpt, stop_after).empty(), "did not stop");
      });
      mp::run(world, ddp::HostTransport::shm, [&](mp::Comm& comm) {  // new processes resume
        const std::string resumed = train_with_checkpoints(comm, ckpt, -1);
        for (const auto& other : comm.all_gather_object(resumed))
          MP_EXPECT(other == resumed, "ranks ended with different parameters");
        if (comm.rank() == 0) mp::TempDir::write(dir.file("resumed"), resumed);
      });
      const std::string whole = mp::TempDir::read(dir.file("whole"));
      CHECK(whole.size() == 7 * sizeof(float));
      CHECK(mp::TempDir::read(dir.file("resumed")) == whole);
    }
  }
}

TEST_CASE("training: a section of typed values is read back as its type only, naming both") {
  mp::TempDir dir;
  ddp::Checkpoint ck;
  std::vector<float> w(1000);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = 0.5f * static_cast<float>(i);
  ck.put_values("w", w);
  struct Pair {  // a trivially copyable type of one's own
    std::int32_t a, b;
  };
  const std::vector<Pair> pairs{{1, 2}, {3, 4}};
  ck.put_values("pairs", pairs);
  ck.put("raw", std::as_bytes(std::span(w)));
  ck.save(dir.file("t.ckpt"));
  const auto back = ddp::Checkpoint::load(dir.file("t.ckpt"));
  REQUIRE(back.has_value());
  const auto refused = [&](auto&& f, const std::string& needle) {
    try {
      f();
      FAIL_CHECK("accepted: " << needle);
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::invalid_argument);
      CHECK_MESSAGE(std::string(e.what()).find(needle) != std::string::npos, e.what());
    }
  };
  // The same bytes (int32[1000]), half as many doubles, twice as many bfloat16: all refused.
  std::vector<std::int32_t> as_int(1000);
  refused([&] { back->get_values("w", std::span(as_int)); },
          "section \"w\" holds float32 (4000 bytes), but 1000 int32 were asked for");
  std::vector<double> as_double(500);
  refused([&] { back->get_values("w", std::span(as_double)); },
          "holds float32 (4000 bytes), but 500 float64 were asked for");
  std::vector<ddp::bfloat16> as_bf16(2000);
  refused([&] { back->get_values("w", std::span(as_bf16)); },
          "holds float32 (4000 bytes), but 2000 bfloat16 were asked for");
  std::vector<float> fewer(999);
  refused([&] { back->get_values("w", std::span(fewer)); },
          "holds 1000 float32, but 999 were asked for");
  std::vector<std::int64_t> as_i64(2);
  refused([&] { back->get_values("pairs", std::span(as_i64)); },
          "holds 8-byte elements (16 bytes), but 2 int64 were asked for");
  // Its own type reads back; raw bytes (put) are of no type: read as any of the right size.
  std::vector<float> same(1000);
  back->get_values("w", std::span(same));
  CHECK(same == w);
  std::vector<Pair> pairs_back(2);
  back->get_values("pairs", std::span(pairs_back));
  CHECK((pairs_back[1].a == 3 && pairs_back[1].b == 4));
  back->get_values("raw", std::span(as_int));
  CHECK(std::memcmp(as_int.data(), w.data(), 4000) == 0);
  CHECK(back->get("w").size() == 4000);  // get() gives any section's bytes
  // A section put again as raw bytes loses its type; put_values again gives it the new one.
  ddp::Checkpoint again = *back;
  again.put("w", std::as_bytes(std::span(as_int)));
  again.get_values("w", std::span(as_int));
  again.put_values("w", as_double);
  again.get_values("w", std::span(as_double));
  refused([&] { again.get_values("w", std::span(same)); }, "holds float64");
}

TEST_CASE("training: checkpoints are written atomically and refused when foreign or damaged") {
  mp::TempDir dir;
  const std::string path = dir.file("a.ckpt");
  ddp::Checkpoint ck;
  const std::vector<double> values{1.5, -2.25, 1e300};
  ck.put_values("values", values);
  ck.put_object("name", std::string("run 7"));
  ck.put_object("sampler", ddp::SamplerState{3, 17, 11, 203, 2});
  ck.put("empty", {});
  ck.save(path);
  auto back = ddp::Checkpoint::load(path);
  REQUIRE(back.has_value());
  CHECK(back->names() ==
        std::vector<std::string>{"values", "ddp.type.values", "name", "sampler", "empty"});
  std::vector<double> got(3);
  back->get_values("values", std::span(got));
  CHECK(got == values);
  CHECK(back->get_object<std::string>("name") == "run 7");
  CHECK(back->get_object<ddp::SamplerState>("sampler").offset == 17u);
  CHECK(back->get("empty").empty());
  CHECK(!ddp::Checkpoint::load(dir.file("absent.ckpt")).has_value());
  // Asking for what is not there, or in another shape.
  std::vector<double> two(2);
  CHECK_THROWS_WITH_AS(back->get_values("values", std::span(two)),
                       doctest::Contains("holds 3 float64, but 2 were asked for"), ddp::Error);
  CHECK_THROWS_WITH_AS(
      (void)back->get("nope"),
      doctest::Contains(
          "no section \"nope\" (it has values, ddp.type.values, name, sampler, empty)"),
      ddp::Error);
  CHECK_THROWS_WITH_AS((void)back->get_object<int>("name"),
                       doctest::Contains("does not hold the type asked for"), ddp::Error);
  // Damaged files: every truncation, a flipped byte anywhere, something else entirely.
  const std::string good = mp::TempDir::read(path);
  const auto refused = [&](const std::string& bytes, const std::string& why) {
    mp::TempDir::write(dir.file("bad.ckpt"), bytes);
    try {
      (void)ddp::Checkpoint::load(dir.file("bad.ckpt"));
      FAIL("a damaged checkpoint was loaded");
    } catch (const ddp::Error& e) {
      CHECK(e.code() == ddp::Errc::protocol);
      CHECK(std::string(e.what()).find(why) != std::string::npos);
      CHECK(std::string(e.what()).find("bad.ckpt") != std::string::npos);
    }
  };
  for (std::size_t n = 0; n < good.size(); ++n) refused(good.substr(0, n), "");
  for (std::size_t i = 0; i < good.size(); ++i) {
    std::string flipped = good;
    flipped[i] = static_cast<char>(flipped[i] ^ 0x20);
    refused(flipped, i < 8 ? "not a ddp checkpoint" : "");
  }
  refused("hello, this is a text file, long enough to look like something", "not a ddp checkpoint");
  refused(good + "x", "checksum does not match");
  // Well-formed files that no save writes (a checksum that matches: made on purpose): a name
  // twice, a typed section that is not a whole number of its elements, a type record that is
  // not text. Refused, and a forged record never quoted raw.
  const auto forged = [&](std::string_view name, const std::string& bytes, const char* type) {
    ddp::Checkpoint f;
    f.put("w", std::as_bytes(std::span(bytes.data(), bytes.size())));
    const std::string t(type);
    ddp::detail::CheckpointRaw::put(f, name, std::as_bytes(std::span(t.data(), t.size())));
    return f;
  };
  const ddp::Checkpoint twice = forged("w", "abcd", "float32");
  CHECK(twice.names() == std::vector<std::string>{"w"});  // replaced in memory, as put does
  const ddp::Checkpoint::Section again[] = {{"v", "one"}, {"v", "two"}};
  refused(twice.serialize_with(again), "two sections have the same name");
  mp::TempDir::write(dir.file("odd.ckpt"), forged("ddp.type.w", "123456", "float32").serialize());
  std::vector<float> one(1);
  CHECK_THROWS_WITH_AS(ddp::Checkpoint::load(dir.file("odd.ckpt"))->get_values("w", std::span(one)),
                       doctest::Contains("holds 6 bytes, not a whole number of float32: the "
                                         "checkpoint is damaged"),
                       ddp::Error);
  mp::TempDir::write(dir.file("raw.ckpt"),
                     forged("ddp.type.w", "1234", "\n\x1b[31mfloat32").serialize());
  try {
    ddp::Checkpoint::load(dir.file("raw.ckpt"))->get_values("w", std::span(one));
    FAIL("a forged type record was accepted");
  } catch (const ddp::Error& e) {
    const std::string w = e.what();
    CHECK(w.find("an unreadable type record (13 bytes)") != std::string::npos);
    CHECK(w.find('\x1b') == std::string::npos);
  }
  // The type records' names are reserved.
  CHECK_THROWS_WITH_AS(ck.put("ddp.type.values", {}), doctest::Contains("is reserved"), ddp::Error);
  CHECK_THROWS_WITH_AS(ck.put_values("ddp.type.x", values), doctest::Contains("is reserved"),
                       ddp::Error);
  // A save that cannot complete leaves the old file as it was and no temporary file behind.
  ::mkdir(dir.file("taken").c_str(), 0755);
  CHECK_THROWS_WITH_AS(ck.save(dir.file("taken")), doctest::Contains("is a directory"), ddp::Error);
  CHECK_THROWS_WITH_AS(ck.save(dir.file("no/such/dir/a.ckpt")), doctest::Contains("cannot create"),
                       ddp::Error);
  ck.put_object("name", std::string("run 8"));
  ck.save(path);
  CHECK(ddp::Checkpoint::load(path)->get_object<std::string>("name") == "run 8");
  int leftovers = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path))
    leftovers += e.path().string().find(".tmp.") != std::string::npos;
  CHECK(leftovers == 0);
}

TEST_CASE("training: load_checkpoint gives every rank the same checkpoint, or the same error") {
  mp::TempDir dir;
  mp::TempDir::write(dir.file("junk.ckpt"), "not a checkpoint at all, just some words");
  mp::run(3, ddp::HostTransport::tcp, [&](mp::Comm& comm) {
    MP_EXPECT(!ddp::load_checkpoint(comm, dir.file("none.ckpt")).has_value(), "a missing file");
    ddp::Checkpoint ck;
    ck.put_object("rank", comm.rank());  // only rank 0's is saved
    ddp::save_checkpoint(comm, ck, dir.file("c.ckpt"));
    const auto back = ddp::load_checkpoint(comm, dir.file("c.ckpt"));
    MP_EXPECT(back && back->get_object<int>("rank") == 0, "rank 0's checkpoint everywhere");
    try {
      (void)ddp::load_checkpoint(comm, dir.file("junk.ckpt"));
      MP_EXPECT(false, "junk was loaded");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::protocol &&
                    std::string(e.what()).find("rank 0 could not load") != std::string::npos &&
                    std::string(e.what()).find("not a ddp checkpoint") != std::string::npos,
                e.what());
    }
    try {
      ddp::save_checkpoint(comm, ck, dir.file("no/such/dir/c.ckpt"));
      MP_EXPECT(false, "a checkpoint was saved into a missing directory");
    } catch (const ddp::Error& e) {
      MP_EXPECT(e.code() == ddp::Errc::system &&
                    std::string(e.what()).find("rank 0 could not save") != std::string::npos,
                e.what());
    }
  });
}

TEST_CASE("training: AsyncSaver writes in the background, one save at a time, errors at wait") {
  mp::TempDir dir;
  const std::string path = dir.file("run.ckpt");
  ddp::AsyncSaver saver;
  CHECK_FALSE(saver.pending());
  std::vector<double> w(100000, 1.5);
  ddp::Checkpoint ck;
  ck.put_values("w", w);
  ck.put_object("step", 1);
  saver.save(ck, path);  // copied: ck may change at once
  CHECK(saver.pending());
  ck.put_object("step", 2);
  saver.save(ck, path);  // waits for the first
  saver.wait();
  CHECK_FALSE(saver.pending());
  auto back = ddp::Checkpoint::load(path);
  REQUIRE(back.has_value());
  CHECK(back->get_object<int>("step") == 2);
  std::vector<double> got(w.size());
  back->get_values("w", std::span(got));
  CHECK(got == w);
  // Moved in: nothing copied; the same file.
  ddp::Checkpoint moved;
  moved.put_values("w", w);
  moved.put_object("step", 3);
  saver.save(std::move(moved), path);
  saver.wait();
  CHECK(ddp::Checkpoint::load(path)->get_object<int>("step") == 3);
  CHECK(ddp::Checkpoint::load(path)->serialize() == ddp::Checkpoint::load(path)->serialize());
  // An error surfaces at wait(), naming the path; the saver goes on afterwards.
  const std::string missing = dir.file("no/such/dir/run.ckpt");
  saver.save(ck, missing);
  try {
    saver.wait();
    FAIL("a save into a missing directory succeeded");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::system);
    CHECK(std::string(e.what()).find(missing) != std::string::npos);
  }
  // ... or at the next save, which then does not start.
  saver.save(ck, missing);
  try {
    saver.save(ck, path);
    FAIL("the earlier save's error was not thrown");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::system);
  }
  CHECK_FALSE(saver.pending());
  CHECK(ddp::Checkpoint::load(path)->get_object<int>("step") == 3);  // not overwritten
  // A symbolic link at the path is refused, never written through.
  const std::string target = dir.file("elsewhere");
  mp::TempDir::write(target, "keep me");
  const std::string link = dir.file("link.ckpt");
  REQUIRE(::symlink(target.c_str(), link.c_str()) == 0);
  saver.save(ck, link);
  try {
    saver.wait();
    FAIL("a save through a symbolic link succeeded");
  } catch (const ddp::Error& e) {
    CHECK(e.code() == ddp::Errc::invalid_argument);
  }
  CHECK(mp::TempDir::read(target) == "keep me");
  // The saver's own checkpoint: kept from one save to the next, its memory reused.
  ddp::AsyncSaver own;
  for (int step = 5; step <= 7; ++step) {
    ddp::Checkpoint& next = own.next();
    if (step > 5) CHECK(next.get_object<int>("step") == step - 1);  // what was last written
    next.put_values("w", w).put_object("step", step);
    own.save(path);
  }
  own.wait();
  CHECK(ddp::Checkpoint::load(path)->get_object<int>("step") == 7);
  // The destructor waits for a save in flight.
  {
    ddp::AsyncSaver last;
    ck.put_object("step", 4);
    last.save(ck, path);
  }
  CHECK(ddp::Checkpoint::load(path)->get_object<int>("step") == 4);
}

}  // namespace checkpoint_tests
