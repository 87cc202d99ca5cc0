# Read by CTest after the discovered doctest cases (tests/CMakeLists.txt): the tests that measure
# a time window or CPU use, which must not share the 2 cores with other tests. A name that is not
# registered (a filtered preset) is ignored.
foreach(_t IN ITEMS
    "a peer killed during a loop of 1 MiB all_reduces: survivors raise peer_lost naming it within 2 s"
    "a stalled peer: the others time out after the timeout, naming it"
    "a frozen peer (SIGSTOP): the others time out between timeout/2 and timeout + 1 s"
    "flight recorder: recent() lists the operations, a timeout dumps them on every rank"
    "spawn with DDP_TRACE_DUMP: failing ranks all write their dumps before the stop"
    "a store out of file descriptors does not spin and recovers"
    "idle connections cannot lock ranks out of the store, and refusals are rate-limited"
    "store: a wait that times out names the missing keys and the client keeps working"
    "store: connecting to nothing times out with a clear message"
    "a rank killed or stopped during the rendezvous: the others fail within one timeout"
    "a rank with a wrong or missing token fails the rendezvous at once, on every rank"
    "rank 0 hosts the store: a rank killed in the rendezvous, or rank 0 itself stopped"
    "a rank out of file descriptors anywhere in init: every rank fails at once, named"
    "a communicator destroyed with async work outstanding finishes it, then leaves"
    "shrink: a stopped rank is left out, and fenced when it wakes"
    "shrink: with the store in rank 0's process, losing rank 0 is named, not waited out")
  set_tests_properties("unit:${_t}" PROPERTIES RUN_SERIAL TRUE)  # doctest_discover_tests drops the prefix's space
endforeach()
