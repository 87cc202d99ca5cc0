# cmake -P CompileFail.cmake: one compile-fail test.
#   COMPILER, STD, INCLUDE, SOURCE, REGEX (the pinned diagnostic), FLAGS (;-list, optional),
#   FIRST_ERROR (optional: REGEX must match the first line that says "error", not any line),
#   MAX_LINES (optional: the compiler's whole output may have at most this many lines),
#   MODE (optional: valid, misuse, or both when unset)
# The source holds a valid program; with -DDDP_COMPILE_FAIL it holds one misuse instead. A
# compile-fail case holds when the valid variant compiles (so the file itself is sound: MODE valid,
# one test per source, since it does not depend on the case) and the misuse fails with a
# diagnostic matching REGEX (so it fails for the reason we pin: MODE misuse).
if(NOT DEFINED MODE OR MODE STREQUAL "")
  set(MODE both)
endif()
set(_required COMPILER STD INCLUDE SOURCE)
if(NOT MODE STREQUAL "valid")
  list(APPEND _required REGEX)
endif()
foreach(_v IN LISTS _required)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "CompileFail.cmake: ${_v} is not set")
  endif()
endforeach()
set(_cmd "${COMPILER}" "-std=${STD}" -fsyntax-only "-I${INCLUDE}" ${FLAGS} "${SOURCE}")
if(NOT MODE STREQUAL "misuse")
  execute_process(COMMAND ${_cmd} RESULT_VARIABLE _ok_rc OUTPUT_VARIABLE _ok_out ERROR_VARIABLE _ok_err)
  if(NOT _ok_rc EQUAL 0)
    message(FATAL_ERROR "the valid variant of ${SOURCE} does not compile:\n${_ok_out}${_ok_err}")
  endif()
  if(MODE STREQUAL "valid")
    message(STATUS "${SOURCE}: the valid variant compiles")
    return()
  endif()
endif()
execute_process(COMMAND ${_cmd} -DDDP_COMPILE_FAIL RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(_rc EQUAL 0)
  message(FATAL_ERROR "${SOURCE} compiled with -DDDP_COMPILE_FAIL, but it must not")
endif()
set(_searched "${_out}${_err}")
if(FIRST_ERROR)
  string(REGEX MATCH "[^\n]*error[^\n]*" _searched "${_searched}")
endif()
if(NOT "${_searched}" MATCHES "${REGEX}")
  message(FATAL_ERROR "${SOURCE} failed to compile, but not with the pinned diagnostic\n"
                      "  expected to match: ${REGEX}\n  got:\n${_out}${_err}")
endif()
if(MAX_LINES)
  string(REGEX MATCHALL "\n" _newlines "${_out}${_err}")
  list(LENGTH _newlines _lines)
  if(_lines GREATER MAX_LINES)
    message(FATAL_ERROR "${SOURCE} was rejected with the pinned diagnostic, but in ${_lines} lines "
                        "(at most ${MAX_LINES}):\n${_out}${_err}")
  endif()
endif()
message(STATUS "${SOURCE}: rejected with the pinned diagnostic")
