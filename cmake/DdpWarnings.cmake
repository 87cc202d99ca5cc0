# ddp_strict(target): the warning set, -Werror and sanitizers for ddp's own programs (tests,
# examples, tools). The library target itself imposes nothing on its users.
function(ddp_strict target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic -Wconversion -Wsign-conversion
                                             -Wshadow -Wnon-virtual-dtor -Wold-style-cast)
    if(DDP_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
    # g++ 12 at -O3 reports std::optional<std::string> and std::vector<std::thread> in
    # libstdc++ itself as maybe uninitialized / out of bounds (GCC bugs 105562, 107852), and
    # std::string's operator+ as an overlapping memcpy (-Wrestrict, GCC bug 105329); g++ 13 does
    # not.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
      target_compile_options(${target} PRIVATE
        "$<$<CONFIG:Release>:-Wno-maybe-uninitialized;-Wno-restrict>")
    endif()
    if(DDP_SANITIZE)
      target_compile_options(${target} PRIVATE -fsanitize=${DDP_SANITIZE} -fno-omit-frame-pointer
                                               -fno-sanitize-recover=all)
      target_link_options(${target} PRIVATE -fsanitize=${DDP_SANITIZE})
    endif()
  endif()
endfunction()

# ddp_test_optimization(target): DDP_TEST_OPTIMIZATION (the ci preset: -O1) for what the test
# suite builds only to run once and check results, not speed: the unit tests, the benchmarks
# (their figures come from bench/run.sh's own Release build), the launch tests' worker, ddprun
# and ddp-trace (scripts/main.sh builds its own Release ddprun), and the examples whose work runs
# in libtorch or CUDA kernels. Most of their compile time goes to optimizing the collectives'
# many instantiations (and libtorch's templates).
function(ddp_test_optimization target)
  if(DDP_TEST_OPTIMIZATION)
    separate_arguments(_opt UNIX_COMMAND "${DDP_TEST_OPTIMIZATION}")
    target_compile_options(${target} PRIVATE ${_opt})
  endif()
endfunction()

# ddp_program_optimization(target): DDP_PROGRAM_OPTIMIZATION (the sanitizer preset: -O0) for the
# programs the suite runs for what they do rather than for how fast (the examples, ddprun,
# ddp-trace and the launch tests' worker), after the build type's and DDP_TEST_OPTIMIZATION.
# The sanitizer stage keeps ddp's implementation unit and the unit tests at -O1, where its tests
# spend their time.
function(ddp_program_optimization target)
  if(DDP_PROGRAM_OPTIMIZATION)
    separate_arguments(_opt UNIX_COMMAND "${DDP_PROGRAM_OPTIMIZATION}")
    target_compile_options(${target} PRIVATE ${_opt})
  endif()
endfunction()

# ddp_gpu_optimization(target): DDP_GPU_OPTIMIZATION (the ci preset: -O0) for the programs that
# run only on a GPU (the CUDA tests, the GPU examples, cuda-bench), after the others: a suite
# without a GPU builds them to check that they compile (scripts/gpu.sh builds its own Release).
function(ddp_gpu_optimization target)
  if(DDP_GPU_OPTIMIZATION)
    separate_arguments(_opt UNIX_COMMAND "${DDP_GPU_OPTIMIZATION}")
    target_compile_options(${target} PRIVATE ${_opt})
  endif()
endfunction()
