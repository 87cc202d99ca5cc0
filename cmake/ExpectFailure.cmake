# cmake -P ExpectFailure.cmake -DPROGRAM=... -DREGEX=...: the program must exit unsuccessfully
# (non-zero or by a signal) and its output must match REGEX.
execute_process(COMMAND "${PROGRAM}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} succeeded, but it must fail\n${out}${err}")
endif()
if(NOT "${out}${err}" MATCHES "${REGEX}")
  message(FATAL_ERROR "${PROGRAM} failed (${rc}) without the expected output\n"
                      "  expected to match: ${REGEX}\n  got:\n${out}${err}")
endif()
message(STATUS "${PROGRAM} failed as expected (${rc})")
