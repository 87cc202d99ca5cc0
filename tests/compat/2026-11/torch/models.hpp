// The libtorch models of the torch example and benchmark (bench/torch/torch_bench.cpp,
// bench/torch/torch_ddp.py defines the same in Python).
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace torch_models {

/// A small CNN for 28x28 images: conv 3x3 (32) - max pool - conv 3x3 (64) - max pool - 128 - 10.
struct CnnImpl : torch::nn::Module {
  CnnImpl()
      : c1(register_module("c1", torch::nn::Conv2d(1, 32, 3))),
        c2(register_module("c2", torch::nn::Conv2d(32, 64, 3))),
        fc1(register_module("fc1", torch::nn::Linear(64 * 5 * 5, 128))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::max_pool2d(torch::relu(c1(x)), 2);
    h = torch::max_pool2d(torch::relu(c2(h)), 2);
    return fc2(torch::relu(fc1(h.flatten(1))));
  }
  torch::nn::Conv2d c1, c2;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Cnn);

/// pytorch/examples' C++ MNIST network (cpp/mnist, cpp/distributed): conv 5x5 (10) - max pool -
/// conv 5x5 (20) - dropout - max pool - 50 - dropout - 10, log-softmax. 21,840 parameters: its
/// step is short, so the per-step cost of averaging shows.
struct MnistNetImpl : torch::nn::Module {
  MnistNetImpl()
      : c1(register_module("c1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 10, 5)))),
        c2(register_module("c2", torch::nn::Conv2d(torch::nn::Conv2dOptions(10, 20, 5)))),
        drop(register_module("drop", torch::nn::Dropout2d())),
        fc1(register_module("fc1", torch::nn::Linear(320, 50))),
        fc2(register_module("fc2", torch::nn::Linear(50, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::relu(torch::max_pool2d(c1(x), 2));
    h = torch::relu(torch::max_pool2d(drop(c2(h)), 2));
    h = torch::relu(fc1(h.view({-1, 320})));
    h = torch::dropout(h, 0.5, is_training());
    return torch::log_softmax(fc2(h), 1);
  }
  torch::nn::Conv2d c1, c2;
  torch::nn::Dropout2d drop;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(MnistNet);

/// The MLP 784-H-H-10 (H = 2048 unless given).
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(std::int64_t hidden = 2048)
      : fc1(register_module("fc1", torch::nn::Linear(784, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return fc3(torch::relu(fc2(torch::relu(fc1(x.view({x.size(0), 784}))))));
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

}  // namespace torch_models
