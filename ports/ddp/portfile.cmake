# vcpkg overlay port, used from a checkout of ddp:
#   vcpkg install ddp --overlay-ports=<ddp checkout>/ports
# It builds from the checkout this file lives in and drives exactly the CMake install that CI
# tests ("package: install" and the find_package consumer in tests/package/).
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)

set(VCPKG_BUILD_TYPE release)  # header-only: one configuration is enough

vcpkg_check_features(OUT_FEATURE_OPTIONS FEATURE_OPTIONS
  FEATURES
    mpi  DDP_WITH_MPI
    nccl DDP_WITH_NCCL)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    ${FEATURE_OPTIONS}
    -DDDP_INSTALL=ON
    -DDDP_BUILD_TESTS=OFF
    -DDDP_BUILD_EXAMPLES=OFF
    -DDDP_BUILD_TOOLS=OFF       # a library port installs no executables into bin/
    -DDDP_BUILD_BENCHMARKS=OFF
    -DDDP_WERROR=OFF)           # a newer compiler's new warning must not fail a user's install
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(CONFIG_PATH share/cmake/ddp)
vcpkg_fixup_pkgconfig()
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/share/doc")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
