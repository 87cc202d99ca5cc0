# ddp::compiled: ddp in the separate-compilation mode (docs/guide/building.md, "Compiled once").
# A static library built from ddp's implementation unit (DDP_COMPILED_SOURCE: a file that includes
# <ddp/impl/src.hpp>), compiled in the project that links it, with that project's compiler and
# flags; what links it compiles with DDP_SEPARATE_COMPILATION, so its units see declarations only.
# Read by ddp's own CMakeLists.txt and by ddpConfig.cmake (find_package(ddp)).
if(NOT TARGET ddp_compiled)
  # EXCLUDE_FROM_ALL: compiled only for a target that links it, never by a plain build of a
  # project that finds ddp and links only ddp::ddp.
  add_library(ddp_compiled STATIC EXCLUDE_FROM_ALL "${DDP_COMPILED_SOURCE}")
  target_link_libraries(ddp_compiled PUBLIC ddp::ddp)
  target_compile_definitions(ddp_compiled PUBLIC DDP_SEPARATE_COMPILATION)
  set_target_properties(ddp_compiled PROPERTIES POSITION_INDEPENDENT_CODE ON)
  add_library(ddp::compiled ALIAS ddp_compiled)
endif()
