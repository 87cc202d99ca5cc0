// Fashion-MNIST for the examples: Debian's dataset-fashion-mnist (IDX files, gzip'd, read with
// zlib), decoded once into a cache directory that later runs and other ranks read directly.
#pragma once

#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <ddp/ddp.hpp>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace fashion_mnist {

inline constexpr const char* default_dir = "/usr/share/datasets/fashion-mnist";

// ---- IDX files (big-endian header), gzip'd ----------------------------------------------------

inline std::string gunzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr)
    throw std::runtime_error("cannot open " + path +
                             " (install the Debian package dataset-fashion-mnist, or pass --data)");
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  const bool ok = n == 0;
  gzclose(f);
  if (!ok) throw std::runtime_error("corrupt gzip file " + path);
  return out;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline std::uint32_t be32(const std::string& s, std::size_t at) {
  std::uint32_t v = 0;
  for (std::size_t k = 0; k < 4; ++k) v = v << 8 | static_cast<unsigned char>(s[at + k]);
  return v;
}

struct Split {
  std::vector<float> images;  // n x 784, scaled to [0, 1]
  std::vector<std::uint8_t> labels;
  [[nodiscard]] std::size_t size() const { return labels.size(); }
};

inline Split parse_idx(const std::string& images, const std::string& labels) {
  if (images.size() < 16 || be32(images, 0) != 0x803 || labels.size() < 8 ||
      be32(labels, 0) != 0x801)
    throw std::runtime_error("not an IDX image/label file pair");
  const std::size_t n = be32(images, 4), rows = be32(images, 8), cols = be32(images, 12);
  if (rows * cols != 784 || be32(labels, 4) != n || images.size() != 16 + n * 784 ||
      labels.size() != 8 + n)
    throw std::runtime_error("unexpected IDX sizes");
  Split s;
  s.images.resize(n * 784);
  for (std::size_t k = 0; k < n * 784; ++k)
    s.images[k] = static_cast<float>(static_cast<unsigned char>(images[16 + k])) / 255.0f;
  s.labels.assign(labels.begin() + 8, labels.end());
  return s;
}

/// Decompresses DATA/NAME.gz into CACHE/NAME unless an earlier run did (written under a temporary
/// name, then renamed, so a reader never sees half a file).
inline void decode_into_cache(const std::string& data, const std::string& cache, const char* name) {
  ::mkdir(cache.c_str(), 0755);
  const std::string out = cache + "/" + name;
  struct stat st {};
  if (::stat(out.c_str(), &st) == 0) return;
  const std::string raw = gunzip(data + "/" + name + ".gz");
  const std::string tmp = out + ".tmp" + std::to_string(::getpid());
  std::ofstream(tmp, std::ios::binary).write(raw.data(), static_cast<std::streamsize>(raw.size()));
  if (std::rename(tmp.c_str(), out.c_str()) != 0) throw std::runtime_error("cannot write " + out);
}

/// The split IMAGES/LABELS ("train-images-idx3-ubyte", ...), decoded through the cache.
inline Split load(const std::string& data, const std::string& cache, const char* images,
                  const char* labels) {
  for (const char* name : {images, labels}) decode_into_cache(data, cache, name);
  return parse_idx(read_file(cache + "/" + images), read_file(cache + "/" + labels));
}

/// The same across ranks: local rank 0 fills the cache first (ZeroFirstGuard); the other ranks of
/// the node wait at the guard, then read the cache.
template <class Comm>
Split load(Comm& comm, const std::string& data, const std::string& cache, const char* images,
           const char* labels) {
  {
    ddp::ZeroFirstGuard guard(comm);
    if (comm.local_rank() == 0) {
      for (const char* name : {images, labels}) decode_into_cache(data, cache, name);
    }
  }
  return parse_idx(read_file(cache + "/" + images), read_file(cache + "/" + labels));
}

}  // namespace fashion_mnist
