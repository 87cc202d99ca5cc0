// ddp — header-only C++20 distributed data-parallel toolkit
// SPDX-License-Identifier: MIT
#pragma once

// The bodies of <ddp/backend/host/shm_segment.hpp>'s non-template functions. That header includes
// this file at its bottom, and nothing else does: in the header-only mode in every unit, in the
// separate-compilation mode in the implementation unit only (<ddp/impl/src.hpp>).

#include <cerrno>
#include <cstring>

DDP_BEGIN_NAMESPACE
namespace detail {

DDP_INLINE std::size_t ShmLayout::slots_offset() const {
  return align_up(header_bytes + static_cast<std::size_t>(world) * ctl_bytes, 4096);
}

DDP_INLINE std::size_t ShmLayout::slot_offset(int rank, unsigned parity) const {
  return slots_offset() + (static_cast<std::size_t>(rank) * 2 + parity) * slot_bytes;
}

DDP_INLINE std::size_t ShmLayout::channels_offset() const {
  return slots_offset() + static_cast<std::size_t>(world) * 2 * slot_bytes;
}

DDP_INLINE std::size_t ShmLayout::channel_offset(int src, int dst) const {
  return channels_offset() + (static_cast<std::size_t>(src) * static_cast<std::size_t>(world) +
                              static_cast<std::size_t>(dst)) *
                                 (channel_ctl_bytes + channel_bytes);
}

DDP_INLINE std::size_t ShmLayout::total() const {
  return align_up(channel_offset(world - 1, world - 1) + channel_ctl_bytes + channel_bytes, 4096);
}

DDP_INLINE bool ShmSegment::create(std::size_t size, std::string& why) {
  fd_ = Fd(::open("/dev/shm", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  std::string where = "/dev/shm";
  if (!fd_) {
    fd_ = Fd(static_cast<int>(::syscall(SYS_memfd_create, "ddp-shm", 1u /* MFD_CLOEXEC */)));
    if (!fd_) fail_errno(errno, "creating shared memory: /dev/shm (O_TMPFILE) and memfd_create");
    where = "shared memory (memfd)";
  }
  const std::size_t avail = free_bytes(where == "/dev/shm");
  if (avail < size) {
    why = concat(where, " has ", mib(avail), " free but the shm transport needs ", mib(size),
                 " for this communicator");
    fd_.reset();
    return false;
  }
  if (const int rc = ::posix_fallocate(fd_.get(), 0, static_cast<off_t>(size)); rc != 0) {
    why = concat("reserving ", mib(size), " in ", where, " failed: ", std::strerror(rc), " (",
                 mib(free_bytes(where == "/dev/shm")), " free)");
    fd_.reset();
    return false;
  }
  map(fd_.get(), size);
  // The file reads as zeros; touch the head (header, control blocks, the first slots) once.
  const std::size_t head = std::min(size, prefault_bytes);
#ifdef MADV_POPULATE_WRITE
  if (::madvise(base_, head, MADV_POPULATE_WRITE) == 0) return true;
#endif
  for (std::size_t i = 0; i < head; i += 4096) reinterpret_cast<volatile char*>(base_)[i] = 0;
  return true;
}

DDP_INLINE void ShmSegment::open(const std::string& path, std::size_t size) {
  Fd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!fd) {
    fail_errno(errno, "opening rank 0's shared memory at ", path,
               " (rank 0 must be alive, of the same user, and dumpable; or use "
               "DDP_HOST_TRANSPORT=tcp)");
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) fail_errno(errno, "fstat(", path, ")");
  if (static_cast<std::size_t>(st.st_size) != size) {
    fail(Errc::protocol, "shared memory segment ", path, " has ", st.st_size, " bytes, expected ",
         size);
  }
  map(fd.get(), size);
}

DDP_INLINE std::byte* ShmSegment::base() const noexcept { return static_cast<std::byte*>(base_); }

DDP_INLINE std::string ShmSegment::mib(std::size_t bytes) {
  if (bytes < (std::size_t{1} << 20)) return concat(bytes / 1024, " KiB (", bytes, " bytes)");
  return concat(bytes / (std::size_t{1} << 20), " MiB (", bytes, " bytes)");
}

DDP_INLINE std::size_t ShmSegment::free_bytes(bool dev_shm) {
  if (dev_shm) {
    struct statvfs v {};
    if (::statvfs("/dev/shm", &v) != 0) return SIZE_MAX;
    return static_cast<std::size_t>(v.f_bavail) * static_cast<std::size_t>(v.f_frsize);
  }
  const long pages = ::sysconf(_SC_AVPHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return SIZE_MAX;
  return static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
}

DDP_INLINE void ShmSegment::map(int fd, std::size_t size) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) fail_errno(errno, "mmap of ", size, " bytes of shared memory");
  base_ = p;
  size_ = size;
}

}  // namespace detail
DDP_END_NAMESPACE
