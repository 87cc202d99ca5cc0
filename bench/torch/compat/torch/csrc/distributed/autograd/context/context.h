// Debian's libtorch-dev 1.13 ships c10d/reducer.hpp but not the header it includes for two names
// of distributed autograd (which reducer-bench never uses): the context type, held by pointer,
// and its gradient callback type, checked by a static_assert. They are declared here as torch
// 1.13's own context.h declares them; the Reducer's layout does not depend on the class's
// members. Used by bench/torch/reducer_bench.cpp only, and only where the real header is absent.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>

namespace torch {
namespace distributed {
namespace autograd {

class DistAutogradContext {
 public:
  using GradCallback = std::function<bool(at::Tensor&)>;
};
using ContextPtr = std::shared_ptr<DistAutogradContext>;

}  // namespace autograd
}  // namespace distributed
}  // namespace torch
