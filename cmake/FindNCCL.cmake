# FindNCCL
# --------
# Finds the NVIDIA Collective Communications Library.
#
# Imported target:  NCCL::NCCL
# Result variables: NCCL_FOUND, NCCL_INCLUDE_DIRS, NCCL_LIBRARIES, NCCL_VERSION
# Hints:            NCCL_ROOT (CMake variable or environment), CUDAToolkit_ROOT, CUDA_HOME,
#                   the CUDA toolkit found by find_package(CUDAToolkit).

set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} $ENV{NCCL_HOME} ${CUDAToolkit_LIBRARY_ROOT}
                ${CUDAToolkit_ROOT} $ENV{CUDA_HOME} /usr/local/cuda)
if(CUDAToolkit_INCLUDE_DIRS)
  list(APPEND _nccl_include_hints ${CUDAToolkit_INCLUDE_DIRS})
endif()

find_path(NCCL_INCLUDE_DIR nccl.h
  HINTS ${_nccl_include_hints} ${_nccl_hints}
  PATH_SUFFIXES include)
# libnccl.so.2 alone: pip's nvidia-nccl-cu* wheels ship no unversioned link (NCCL_ROOT=<site-packages>/nvidia/nccl).
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2
  HINTS ${CUDAToolkit_LIBRARY_DIR} ${_nccl_hints}
  PATH_SUFFIXES lib64 lib lib/x86_64-linux-gnu)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_version_lines
       REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_line IN LISTS _nccl_version_lines)
    string(REGEX MATCH "NCCL_(MAJOR|MINOR|PATCH) +([0-9]+)" _ "${_line}")
    set(_nccl_${CMAKE_MATCH_1} ${CMAKE_MATCH_2})
  endforeach()
  if(DEFINED _nccl_MAJOR)
    set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND)
  set(NCCL_INCLUDE_DIRS "${NCCL_INCLUDE_DIR}")
  set(NCCL_LIBRARIES "${NCCL_LIBRARY}")
  if(NOT TARGET NCCL::NCCL)
    add_library(NCCL::NCCL UNKNOWN IMPORTED)
    set_target_properties(NCCL::NCCL PROPERTIES
      IMPORTED_LOCATION "${NCCL_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
  endif()
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
