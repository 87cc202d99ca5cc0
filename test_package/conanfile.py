import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout


class DdpTestPackage(ConanFile):
    settings = "os", "arch", "compiler", "build_type"
    generators = "CMakeDeps"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        # The backend components the tested package was configured with (-o ddp/*:with_mpi=True).
        options = self.dependencies["ddp"].options
        toolchain = CMakeToolchain(self)
        toolchain.variables["DDP_TEST_MPI"] = bool(options.with_mpi)
        toolchain.variables["DDP_TEST_NCCL"] = bool(options.with_nccl)
        toolchain.variables["DDP_TEST_TORCH"] = bool(options.with_torch)
        toolchain.variables["DDP_TEST_COMPILED"] = bool(options.compiled)
        toolchain.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if can_run(self):
            self.run(os.path.join(self.cpp.build.bindir, "test_package"), env="conanrun")
            options = self.dependencies["ddp"].options
            if options.with_mpi or options.with_nccl:
                self.run(os.path.join(self.cpp.build.bindir, "test_components"), env="conanrun")
            if options.with_torch:
                self.run(os.path.join(self.cpp.build.bindir, "test_torch"), env="conanrun")
            if options.compiled:
                self.run(os.path.join(self.cpp.build.bindir, "test_compiled"), env="conanrun")
