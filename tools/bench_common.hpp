// Shared by tools/ddp-bench and bench/mpi-bench: sizes, bus-bandwidth factors, the
// nccl-tests-style table, CSV/JSON output and an SVG plot of bus bandwidth against size.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace bench {

struct Row {
  std::string op;
  std::uint64_t bytes = 0;  // nccl-tests "size": the whole buffer (all_gather: the output)
  std::uint64_t count = 0;  // elements in that buffer
  std::string dtype;
  std::string redop;
  double time_us = 0;  // per call, slowest rank, averaged over iterations
  double algbw = 0;    // GB/s
  double busbw = 0;    // GB/s
  int iterations = 0;
};

/// "64M" -> 67108864; accepts K, M, G suffixes (powers of 1024).
inline std::uint64_t parse_size(const std::string& s) {
  if (s.empty()) throw std::invalid_argument("empty size");
  std::size_t pos = 0;
  const auto v = std::stoull(s, &pos);
  std::uint64_t mult = 1;
  if (pos < s.size()) {
    switch (s[pos]) {
      case 'k':
      case 'K': mult = 1ull << 10; break;
      case 'm':
      case 'M': mult = 1ull << 20; break;
      case 'g':
      case 'G': mult = 1ull << 30; break;
      default: throw std::invalid_argument("bad size suffix in " + s);
    }
  }
  return v * mult;
}

inline std::string human(std::uint64_t b) {
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) return fmt::format("{}G", b >> 30);
  if (b >= (1ull << 20) && b % (1ull << 20) == 0) return fmt::format("{}M", b >> 20);
  if (b >= (1ull << 10) && b % (1ull << 10) == 0) return fmt::format("{}K", b >> 10);
  return fmt::format("{}", b);
}

/// nccl-tests' bus bandwidth factors: the fraction of the data each rank's link must carry.
inline double bus_factor(const std::string& op, int p) {
  const double n = p;
  if (op == "all_reduce") return 2 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all" || op == "gather" ||
      op == "scatter") {
    return (n - 1) / n;
  }
  return 1.0;  // broadcast, reduce
}

inline void print_header(std::FILE* out, const std::string& title) {
  fmt::print(out, "# {}\n", title);
  fmt::print(out, "# {:>12} {:>12} {:>9} {:>6} {:>11} {:>10} {:>10}\n", "size(B)", "count", "type",
             "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)");
}

inline void print_row(std::FILE* out, const Row& r) {
  fmt::print(out, "  {:>12} {:>12} {:>9} {:>6} {:>11.2f} {:>10.2f} {:>10.2f}\n", r.bytes, r.count,
             r.dtype, r.redop.empty() ? "-" : r.redop, r.time_us, r.algbw, r.busbw);
  std::fflush(out);
}

inline void write_csv(const std::string& path, const std::vector<Row>& rows,
                      const std::string& label) {
  std::ofstream f(path);
  f << "label,op,bytes,count,dtype,redop,time_us,algbw_gbps,busbw_gbps,iterations\n";
  for (const auto& r : rows) {
    f << fmt::format("{},{},{},{},{},{},{:.3f},{:.4f},{:.4f},{}\n", label, r.op, r.bytes, r.count,
                     r.dtype, r.redop, r.time_us, r.algbw, r.busbw, r.iterations);
  }
}

inline void write_json(const std::string& path, const std::vector<Row>& rows,
                       const std::string& label) {
  std::ofstream f(path);
  f << "{\"label\": \"" << label << "\", \"results\": [\n";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    f << fmt::format(
        "  {{\"op\": \"{}\", \"bytes\": {}, \"count\": {}, \"dtype\": \"{}\", \"redop\": \"{}\", "
        "\"time_us\": {:.3f}, "
        "\"algbw_gbps\": {:.4f}, \"busbw_gbps\": {:.4f}, \"iterations\": {}}}{}\n",
        r.op, r.bytes, r.count, r.dtype, r.redop, r.time_us, r.algbw, r.busbw, r.iterations,
        i + 1 < rows.size() ? "," : "");
  }
  f << "]}\n";
}

/// Reads rows written by write_csv (any label).
inline std::vector<std::pair<std::string, Row>> read_csv(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot read " + path);
  std::string line;
  std::getline(f, line);
  std::vector<std::pair<std::string, Row>> out;
  while (std::getline(f, line)) {
    std::stringstream ss(line);
    std::vector<std::string> c;
    std::string cell;
    while (std::getline(ss, cell, ',')) c.push_back(cell);
    if (c.size() < 10) continue;
    Row r;
    r.op = c[1];
    r.bytes = std::stoull(c[2]);
    r.count = std::stoull(c[3]);
    r.dtype = c[4];
    r.redop = c[5];
    r.time_us = std::stod(c[6]);
    r.algbw = std::stod(c[7]);
    r.busbw = std::stod(c[8]);
    r.iterations = std::stoi(c[9]);
    out.emplace_back(c[0], r);
  }
  return out;
}

/// An SVG line chart of bus bandwidth against size (log2 axis), one line per label.
inline void write_svg(const std::string& path,
                      const std::map<std::string, std::vector<Row>>& series,
                      const std::string& title) {
  const double w = 760, h = 440, left = 70, right = 160, top = 40, bottom = 50;
  double xmin = 1e300, xmax = 0, ymax = 0;
  for (const auto& [label, rows] : series) {
    for (const auto& r : rows) {
      if (r.bytes == 0) continue;
      xmin = std::min(xmin, std::log2(static_cast<double>(r.bytes)));
      xmax = std::max(xmax, std::log2(static_cast<double>(r.bytes)));
      ymax = std::max(ymax, r.busbw);
    }
  }
  if (xmax <= xmin) xmax = xmin + 1;
  ymax = ymax <= 0 ? 1 : std::ceil(ymax * 1.1);
  const auto X = [&](double lb) { return left + (lb - xmin) / (xmax - xmin) * (w - left - right); };
  const auto Y = [&](double v) { return h - bottom - v / ymax * (h - top - bottom); };
  std::ofstream f(path);
  f << fmt::format(
      "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' "
      "font-size='12'>\n",
      w, h);
  f << "<rect width='100%' height='100%' fill='white'/>\n";
  f << fmt::format("<text x='{}' y='22' font-size='15'>{}</text>\n", left, title);
  for (int i = 0; i <= 5; ++i) {
    const double v = ymax * i / 5, y = Y(v);
    f << fmt::format("<line x1='{}' y1='{:.1f}' x2='{}' y2='{:.1f}' stroke='#ddd'/>\n", left, y,
                     w - right, y);
    f << fmt::format("<text x='{}' y='{:.1f}' text-anchor='end'>{:.1f}</text>\n", left - 6, y + 4,
                     v);
  }
  for (int lb = static_cast<int>(std::ceil(xmin)); lb <= static_cast<int>(xmax); lb += 2) {
    const double x = X(lb);
    f << fmt::format("<line x1='{:.1f}' y1='{}' x2='{:.1f}' y2='{}' stroke='#eee'/>\n", x, top, x,
                     h - bottom);
    f << fmt::format("<text x='{:.1f}' y='{}' text-anchor='middle'>{}</text>\n", x, h - bottom + 16,
                     human(1ull << lb));
  }
  f << fmt::format("<text x='{}' y='{}' text-anchor='middle'>message size (bytes)</text>\n",
                   (left + w - right) / 2, h - 12);
  f << fmt::format(
      "<text x='16' y='{}' transform='rotate(-90 16 {})' text-anchor='middle'>bus bandwidth "
      "(GB/s)</text>\n",
      (top + h - bottom) / 2, (top + h - bottom) / 2);
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
  int k = 0;
  for (const auto& [label, rows] : series) {
    const char* color = colors[k % 6];
    std::string points;
    for (const auto& r : rows) {
      if (r.bytes == 0) continue;
      points +=
          fmt::format("{:.1f},{:.1f} ", X(std::log2(static_cast<double>(r.bytes))), Y(r.busbw));
    }
    f << fmt::format("<polyline fill='none' stroke='{}' stroke-width='2' points='{}'/>\n", color,
                     points);
    const double ly = top + 20.0 * k;
    f << fmt::format(
        "<line x1='{}' y1='{:.1f}' x2='{}' y2='{:.1f}' stroke='{}' stroke-width='3'/>\n",
        w - right + 10, ly, w - right + 30, ly, color);
    f << fmt::format("<text x='{}' y='{:.1f}'>{}</text>\n", w - right + 36, ly + 4, label);
    ++k;
  }
  f << "</svg>\n";
}

}  // namespace bench
