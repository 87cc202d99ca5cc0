// ddp's implementation unit (ddp::compiled): the separate-compilation mode.
#include <ddp/impl/src.hpp>
