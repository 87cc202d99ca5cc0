// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

/// \file
/// Reading the ranks' timelines back (what ddp/observe/timeline.hpp writes), for ddp-trace and its
/// tests: read_timeline() (one file, repaired when its process died mid-write), merge_timelines()
/// (every rank's events in one Chrome trace-event document, on rank 0's clock as written),
/// summarize_steps() (per rank: step time, time in collectives, how much of it overlapped the
/// computation, the wait at the end of the step) and draw_step() (one step of every rank as SVG:
/// the step, the program's own spans, each bucket's comm hook and collective, the wait). Like
/// every tool header, it includes nothing of ddp but <ddp/ddp.hpp>.

#include <ddp/ddp.hpp>

#include <dirent.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

DDP_BEGIN_NAMESPACE

/// One rank's timeline, read back (a file of its own, or its part of a merged one).
struct TimelineFile {
  /// A span ("X" event) of the file.
  struct Span {
    std::string name, cat;
    double ts = 0, dur = 0;  ///< microseconds, on rank 0's clock
    int tid = 0;             ///< 0 steps, 1 buckets, 2... one per communicator group
    long bucket = -1;        ///< the bucket whose hook issued a collective (-1: none)
    long step = -1;          ///< a step span's number
    [[nodiscard]] double end() const { return ts + dur; }
  };
  std::string path;
  int rank = -1;
  std::string run;  ///< the run it belongs to ("" when its process did not learn it)
  std::vector<std::string> events;  ///< every event, as JSON text
  std::vector<Span> spans;
  bool repaired = false;  ///< the file ended mid-event (its process died): cut at the last one
};

namespace detail {
/// `v` as JSON text (what parse_json read).
inline void json_text(const Json& v, std::string& out) {
  switch (v.type) {
    case Json::Type::null: out += "null"; return;
    case Json::Type::boolean: out += v.boolean ? "true" : "false"; return;
    case Json::Type::number: out += v.text; return;
    case Json::Type::string: out += json_quoted(v.text); return;
    case Json::Type::array:
      out += '[';
      for (std::size_t i = 0; i < v.items.size(); ++i) {
        if (i != 0) out += ',';
        json_text(v.items[i], out);
      }
      out += ']';
      return;
    case Json::Type::object:
      out += '{';
      for (std::size_t i = 0; i < v.items.size(); ++i) {
        if (i != 0) out += ',';
        out += json_quoted(v.names[i]);
        out += ':';
        json_text(v.items[i], out);
      }
      out += '}';
      return;
  }
}

/// A number of a JSON value ("12.5", or a string of one); `otherwise` when it is not one.
inline double json_number(const Json* v, double otherwise) {
  if (v == nullptr || (v->type != Json::Type::number && v->type != Json::Type::string))
    return otherwise;
  char* end = nullptr;
  const double d = std::strtod(v->text.c_str(), &end);
  return end != v->text.c_str() && *end == '\0' ? d : otherwise;
}
}  // namespace detail

/// Reads one timeline file: a rank's own (ddp/observe/timeline.hpp), or one ddp-trace merged (then
/// one TimelineFile per rank in it). Errc::protocol naming the file when it holds no trace
/// events; a file cut short (its process killed mid-write) is read up to its last event.
[[nodiscard]] inline std::vector<TimelineFile> read_timeline(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) detail::fail(Errc::system, "cannot read ", path, ": ", std::strerror(errno));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  if (text.empty()) detail::fail(Errc::protocol, path, ": empty (its process wrote nothing)");
  detail::Json doc;
  bool repaired = false;
  try {
    doc = detail::parse_json(text, 16);
  } catch (const Error&) {  // cut short: keep the events up to the last complete one
    const std::size_t last = text.rfind("},\n");  // ddp separates events by ",\n"
    if (last == std::string::npos)
      detail::fail(Errc::protocol, path, ": not a ddp timeline (unreadable JSON)");
    text.resize(last + 1);
    text += "\n]}\n";
    try {
      doc = detail::parse_json(text, 16);
    } catch (const Error& e) {
      detail::fail(Errc::protocol, path, ": not a ddp timeline (", e.what(), ")");
    }
    repaired = true;
  }
  const detail::Json* events = doc.find("traceEvents");
  if (events == nullptr || events->type != detail::Json::Type::array)
    detail::fail(Errc::protocol, path, ": not a ddp timeline (no traceEvents array)");
  std::map<int, TimelineFile> by_rank;  // a ddp file holds one rank; a merged one several
  for (const auto& e : events->items) {
    if (e.type != detail::Json::Type::object) continue;
    const double pid = detail::json_number(e.find("pid"), -1);
    if (pid < 0 || pid > 1e7) continue;
    TimelineFile& f = by_rank[static_cast<int>(pid)];
    f.path = path;
    f.rank = static_cast<int>(pid);
    f.repaired = repaired;
    std::string event;
    detail::json_text(e, event);
    f.events.push_back(std::move(event));
    const std::string ph = e.get("ph");
    const detail::Json* args = e.find("args");
    if (ph == "M" && e.get("name") == "ddp_clock" && args != nullptr) f.run = args->get("run");
    if (ph != "X") continue;
    TimelineFile::Span s;
    s.name = e.get("name");
    s.cat = e.get("cat");
    s.ts = detail::json_number(e.find("ts"), 0);
    s.dur = std::max(detail::json_number(e.find("dur"), 0), 0.0);
    s.tid = static_cast<int>(detail::json_number(e.find("tid"), 0));
    if (args != nullptr) {
      s.bucket = static_cast<long>(detail::json_number(args->find("bucket"), -1));
      s.step = static_cast<long>(detail::json_number(args->find("step"), -1));
    }
    f.spans.push_back(std::move(s));
  }
  if (by_rank.empty()) detail::fail(Errc::protocol, path, ": not a ddp timeline (no events)");
  std::vector<TimelineFile> out;
  for (auto& [rank, f] : by_rank) out.push_back(std::move(f));
  return out;
}

/// The timeline files (ddp-timeline-rank*.json) in `dir`, ordered by rank. A file that cannot be
/// read is left out, its path and why in `skipped`.
[[nodiscard]] inline std::vector<TimelineFile> read_timelines(const std::string& dir,
                                                              std::vector<std::string>& skipped) {
  std::vector<TimelineFile> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return out;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.starts_with("ddp-timeline-rank") && name.ends_with(".json")) names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    try {
      for (auto& f : read_timeline(dir + "/" + name)) out.push_back(std::move(f));
    } catch (const Error& e) {
      skipped.push_back(e.what());
    }
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const TimelineFile& a, const TimelineFile& b) { return a.rank < b.rank; });
  return out;
}

/// The files of one run: those of the latest run (the one rank 0 started last) and those that
/// name no run; the others' paths in `older`.
[[nodiscard]] inline std::vector<TimelineFile> latest_run(std::vector<TimelineFile> files,
                                                          std::vector<std::string>& older) {
  const auto started = [](const std::string& run) {  // "... at <ns>"
    const std::size_t at = run.rfind(" at ");
    return at == std::string::npos ? 0.0 : std::strtod(run.c_str() + at + 4, nullptr);
  };
  std::string latest;
  for (const auto& f : files)
    if (!f.run.empty() && (latest.empty() || started(f.run) > started(latest))) latest = f.run;
  std::vector<TimelineFile> out;
  for (auto& f : files) {
    if (f.run.empty() || f.run == latest)
      out.push_back(std::move(f));
    else
      older.push_back(f.path);
  }
  return out;
}

/// Every file's events in one Chrome trace-event document (Perfetto, chrome://tracing).
[[nodiscard]] inline std::string merge_timelines(const std::vector<TimelineFile>& files) {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  for (const auto& f : files) {
    for (const auto& e : f.events) {
      if (!first) out += ",\n";
      out += e;
      first = false;
    }
  }
  return out + "\n]}\n";
}

/// One rank's steps, summed up.
struct StepSummary {
  int rank = -1;
  long steps = 0;
  double step_us = 0;        ///< mean step time
  double comm_us = 0;        ///< mean time in collectives per step
  double overlapped_us = 0;  ///< ... of it outside synchronize(): overlapping the computation
  double wait_us = 0;        ///< mean time in synchronize(), waiting for the buckets
  bool cut_short = false;    ///< its file ended mid-event: the process was killed
};

namespace detail {
/// `text` with &, < and > escaped, for SVG text.
inline std::string xml_escaped(std::string_view text) {
  std::string out;
  for (const char c : text) {
    if (c == '&')
      out += "&amp;";
    else if (c == '<')
      out += "&lt;";
    else if (c == '>')
      out += "&gt;";
    else
      out += c;
  }
  return out;
}

/// The length of [a, b) covered by `spans` (which may overlap each other) on [from, to).
inline double covered(std::vector<std::pair<double, double>> spans, double from, double to) {
  std::sort(spans.begin(), spans.end());
  double total = 0, reach = from;
  for (auto [a, b] : spans) {
    a = std::max(a, reach);
    b = std::min(b, to);
    if (b > a) {
      total += b - a;
      reach = b;
    }
  }
  return total;
}
}  // namespace detail

/// Per rank: the steps (GradientAverager's "step N" spans) and what happened in them.
[[nodiscard]] inline std::vector<StepSummary> summarize_steps(
    const std::vector<TimelineFile>& files) {
  std::vector<StepSummary> out;
  for (const auto& f : files) {
    StepSummary s;
    s.rank = f.rank;
    s.cut_short = f.repaired;
    for (const auto& step : f.spans) {
      if (step.cat != "step" || step.step < 0) continue;
      ++s.steps;
      s.step_us += step.dur;
      std::vector<std::pair<double, double>> comm, waits;
      for (const auto& x : f.spans) {
        if (x.end() <= step.ts || x.ts >= step.end()) continue;
        if (x.cat == "collective") comm.emplace_back(x.ts, x.end());
        if (x.cat == "step" && x.name == "synchronize") waits.emplace_back(x.ts, x.end());
      }
      const double in_comm = detail::covered(comm, step.ts, step.end());
      double in_comm_waiting = 0;
      for (const auto& [a, b] : waits) {
        s.wait_us += b - a;
        in_comm_waiting += detail::covered(comm, a, b);
      }
      s.comm_us += in_comm;
      s.overlapped_us += in_comm - in_comm_waiting;
    }
    if (s.steps > 0) {
      const auto n = static_cast<double>(s.steps);
      s.step_us /= n;
      s.comm_us /= n;
      s.overlapped_us /= n;
      s.wait_us /= n;
    }
    out.push_back(s);
  }
  return out;
}

/// The summary as text, one line per rank.
[[nodiscard]] inline std::string format_steps(const std::vector<StepSummary>& all) {
  std::string out;
  for (const auto& s : all) {
    char line[256];
    if (s.steps == 0) {
      std::snprintf(line, sizeof line, "rank %d: no steps (no GradientAverager::synchronize)\n",
                    s.rank);
    } else {
      const double pct = s.comm_us > 0 ? 100.0 * s.overlapped_us / s.comm_us : 0.0;
      std::snprintf(line, sizeof line,
                    "rank %d: %ld steps, %.3f ms each: collectives %.3f ms (%.0f%% overlapped "
                    "with the computation), waiting for them %.3f ms\n",
                    s.rank, s.steps, s.step_us / 1e3, s.comm_us / 1e3, pct, s.wait_us / 1e3);
    }
    out += line;
    if (s.cut_short) {
      out.pop_back();
      out += " (its file ends mid-event: the process was killed)\n";
    }
  }
  return out;
}

/// Step `step` of every rank as an SVG picture (-1: the last step every rank finished): a row
/// per rank and track (steps, buckets, collectives), one time axis. Errc::invalid_argument when
/// no rank has that step.
[[nodiscard]] inline std::string draw_step(const std::vector<TimelineFile>& files, long step = -1) {
  if (step < 0) {
    long common = -1;
    bool first = true;
    for (const auto& f : files) {
      long last = -1;
      for (const auto& s : f.spans)
        if (s.cat == "step" && s.step >= 0) last = std::max(last, s.step);
      common = first ? last : std::min(common, last);
      first = false;
    }
    step = common;
    if (step < 0)
      detail::fail(Errc::invalid_argument,
                   "no rank's timeline has a step (each GradientAverager::synchronize() ends one)");
  }
  double from = 0, to = 0;
  bool any = false;
  for (const auto& f : files) {
    for (const auto& s : f.spans) {
      if (s.cat != "step" || s.step != step) continue;
      from = any ? std::min(from, s.ts) : s.ts;
      to = any ? std::max(to, s.end()) : s.end();
      any = true;
    }
  }
  if (!any || step < 0)
    detail::fail(Errc::invalid_argument, "no rank's timeline has step ", step,
                 " (GradientAverager::synchronize ends each step)");
  const double width = 1200, left = 110, row = 18, gap = 10;
  const double scale = (width - left - 20) / std::max(to - from, 1.0);
  const auto x = [&](double t) { return left + (std::clamp(t, from, to) - from) * scale; };
  static constexpr const char* palette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759",
                                            "#76b7b2", "#edc948", "#b07aa1", "#9c755f"};
  std::string body;
  double y = 40;
  char buf[512];
  const auto rect = [&](double a, double b, double top, double h, const char* fill, const char* cls,
                        const std::string& title, std::string_view label) {
    const double w = std::max(x(b) - x(a), 0.5);
    std::snprintf(buf, sizeof buf,
                  "<rect class=\"%s\" x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" "
                  "fill=\"%s\"><title>",
                  cls, x(a), top, w, h, fill);
    body += buf;
    body += detail::xml_escaped(title);
    body += "</title></rect>\n";
    // The name inside, where it fits (about 6 px a character at this size).
    const auto fits = static_cast<std::size_t>(std::max(w - 4, 0.0) / 6);
    if (!label.empty() && fits >= 3) {
      std::snprintf(buf, sizeof buf,
                    "<text x=\"%.2f\" y=\"%.2f\" font-size=\"9\" fill=\"#222\" "
                    "pointer-events=\"none\">",
                    x(a) + 2, top + h - 3);
      body += buf;
      body += detail::xml_escaped(label.substr(0, fits));
      body += "</text>\n";
    }
  };
  static constexpr const char* greens[] = {"#8cd17d", "#b6e3a8", "#59a14f", "#a0cbe8"};
  const auto green = [&](const std::string& name) {
    return greens[std::hash<std::string>{}(name) % 4];
  };
  for (const auto& f : files) {
    // This rank's own step: what it did then (the ranks' steps start and end a little apart).
    double mine_from = to, mine_to = from;
    for (const auto& s : f.spans) {
      if (s.cat != "step" || s.step != step) continue;
      mine_from = s.ts;
      mine_to = s.end();
    }
    std::snprintf(buf, sizeof buf, "<g id=\"rank-%d\">\n<text x=\"4\" y=\"%.2f\">rank %d</text>\n",
                  f.rank, y + row - 4, f.rank);
    body += buf;
    for (int track = 0; track < 3; ++track) {
      const double top = y + track * row;
      static constexpr const char* names[] = {"step", "buckets", "comm"};
      std::snprintf(buf, sizeof buf,
                    "<text x=\"56\" y=\"%.2f\" font-size=\"10\" fill=\"#666\">%s</text>\n",
                    top + row - 6, names[track]);
      body += buf;
      // The step first, under what happened in it.
      std::vector<const TimelineFile::Span*> order;
      for (const auto& s : f.spans)
        if (s.cat == "step" && s.step == step)
          order.insert(order.begin(), &s);
        else
          order.push_back(&s);
      for (const auto* sp : order) {
        const auto& s = *sp;
        if (std::min(s.end(), mine_to) - std::max(s.ts, mine_from) < 1.0) continue;  // not in it
        char ms[32];
        std::snprintf(ms, sizeof ms, "%.3f", s.dur / 1e3);
        const std::string title = s.name + " (" + ms + " ms)";
        if (track == 0 && s.tid == 0) {
          if (s.cat == "step" && s.step == step)
            rect(s.ts, s.end(), top + 2, row - 4, "#d9d9d9", "step", title, {});
          else if (s.name == "synchronize")
            rect(s.ts, s.end(), top + 2, row - 4, "#ff9da7", "wait", title, "wait");
          else if (s.cat != "step")
            rect(s.ts, s.end(), top + 3, row - 6, green(s.name), "compute", title, s.name);
        } else if (track == 1 && s.tid == 1) {
          rect(s.ts, s.end(), top + 4, row - 8,
               palette[static_cast<std::size_t>(std::max(s.bucket, 0L)) % 8], "hook", title, {});
        } else if (track == 2 && s.tid >= 2 && s.tid < 1000) {
          const char* fill =
              s.bucket >= 0 ? palette[static_cast<std::size_t>(s.bucket) % 8] : "#bab0ac";
          rect(s.ts, s.end(), top + 2, row - 4, fill, s.bucket >= 0 ? "bucket" : "collective",
               title, s.bucket >= 0 ? "b" + std::to_string(s.bucket) : s.name);
        }
      }
    }
    body += "</g>\n";
    y += 3 * row + gap;
  }
  std::string out;
  std::snprintf(buf, sizeof buf,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" "
                "height=\"100%%\" fill=\"white\"/>\n<text x=\"4\" y=\"16\">step %ld, %.3f ms: "
                "grey the step, green the program's spans, pink the wait in synchronize(), "
                "colours the buckets (hook, then its collective)</text>\n",
                width, y + 20, step, (to - from) / 1e3);
  out += buf;
  out += body;
  std::snprintf(buf, sizeof buf,
                "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#333\"/>\n"
                "<text x=\"%.2f\" y=\"%.2f\" font-size=\"10\">0</text>\n"
                "<text x=\"%.2f\" y=\"%.2f\" font-size=\"10\" text-anchor=\"end\">%.3f ms</text>\n",
                left, y, width - 20, y, left, y + 12, width - 20, y + 12, (to - from) / 1e3);
  out += buf;
  return out + "</svg>\n";
}

DDP_END_NAMESPACE
