# cmake -P install.cmake -DBUILD_DIR=... -DPREFIX=...: a clean install of ddp into PREFIX.
file(REMOVE_RECURSE "${PREFIX}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${PREFIX}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install failed")
endif()
foreach(f include/ddp/ddp.hpp share/cmake/ddp/ddpConfig.cmake share/cmake/ddp/ddpConfigVersion.cmake
          share/cmake/ddp/ddpTargets.cmake share/cmake/ddp/FindNCCL.cmake share/pkgconfig/ddp.pc)
  if(NOT EXISTS "${PREFIX}/${f}")
    message(FATAL_ERROR "the install is missing ${f}")
  endif()
endforeach()
