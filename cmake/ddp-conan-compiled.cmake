# ddp::compiled for Conan's CMakeDeps (conan create -o "ddp/*:compiled=True"): the package holds
# ddp's implementation unit and cmake/ddpCompiled.cmake, which build the static library in the
# consumer's project, with its compiler and flags, as find_package(ddp) does for a CMake install.
set(DDP_COMPILED_SOURCE "${CMAKE_CURRENT_LIST_DIR}/ddp_compiled.cpp")
include("${CMAKE_CURRENT_LIST_DIR}/ddpCompiled.cmake")
