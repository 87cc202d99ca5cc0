# ddp::torch for Conan consumers (-o ddp/*:with_torch=True), included by the find_package(ddp)
# that Conan's CMakeDeps generates: ddp is header-only, so the adapter links the consumer's own
# libtorch, found as CMake users find it (libtorch's CMake directory on CMAKE_PREFIX_PATH).
if(TARGET ddp::torch AND NOT DEFINED _ddp_conan_torch_linked)
  set(_ddp_conan_torch_linked TRUE)
  find_package(Torch QUIET)
  if(NOT (Torch_FOUND OR TORCH_FOUND))
    message(FATAL_ERROR
      "ddp::torch (ddp/*:with_torch=True) needs libtorch, and find_package(Torch) found none: "
      "put libtorch's CMake directory on CMAKE_PREFIX_PATH (pip's torch: python3 -c 'import "
      "torch.utils; print(torch.utils.cmake_prefix_path)'; Debian: apt-get install libtorch-dev)")
  endif()
  set_property(TARGET ddp::torch APPEND PROPERTY INTERFACE_LINK_LIBRARIES ${TORCH_LIBRARIES})
endif()
