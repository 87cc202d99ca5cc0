import os

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.files import copy
from conan.tools.gnu import PkgConfig
from conan.tools.layout import basic_layout

required_conan_version = ">=2.0"


class DdpConan(ConanFile):
    name = "ddp"
    version = "0.1.0"
    description = "Header-only C++20 toolkit for distributed data-parallel training"
    license = "MIT"
    topics = ("distributed", "collectives", "allreduce", "ddp", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    # The optional backends, as the CMake components ddp::mpi and ddp::nccl: each adds a component
    # (ddp::mpi / ddp::nccl) with its define and the system library it links. The libraries come
    # from the system, not from Conan packages: MPI through pkg-config's mpi-cxx (Open MPI, MPICH),
    # CUDA and NCCL from the conf user.ddp:cuda_root (else $CUDA_HOME, else /usr/local/cuda) and
    # user.ddp:nccl_root (else $NCCL_ROOT, else the CUDA root). with_torch adds ddp::torch, the
    # libtorch adapter, linked to the consumer's own libtorch: find_package(ddp) then runs
    # find_package(Torch) (libtorch's CMake directory on CMAKE_PREFIX_PATH, as for CMake users).
    # compiled adds ddp::compiled, the separate-compilation mode (README "Compiled once"): a static
    # library of ddp's implementation unit that CMakeDeps consumers build in their own project.
    options = {"with_mpi": [True, False], "with_nccl": [True, False], "with_torch": [True, False],
               "compiled": [True, False]}
    default_options = {"with_mpi": False, "with_nccl": False, "with_torch": False,
                       "compiled": False}
    exports_sources = ("include/*", "LICENSE", "cmake/ddp-conan-torch.cmake",
                       "cmake/ddp-conan-compiled.cmake", "cmake/ddpCompiled.cmake",
                       "cmake/ddp_compiled.cpp")
    no_copy_source = True

    def layout(self):
        basic_layout(self, src_folder=".")

    def package_id(self):
        self.info.clear()  # the same headers for every configuration

    def package(self):
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        for pattern in ("*.hpp", "*.ipp"):  # the headers and their bodies
            copy(self, pattern, os.path.join(self.source_folder, "include"),
                 os.path.join(self.package_folder, "include"))
        for f in ("ddp-conan-torch.cmake", "ddp-conan-compiled.cmake", "ddpCompiled.cmake",
                  "ddp_compiled.cpp"):
            copy(self, f, os.path.join(self.source_folder, "cmake"),
                 os.path.join(self.package_folder, "lib", "cmake"))

    def _cuda_roots(self):
        cuda = self.conf.get("user.ddp:cuda_root", default=os.environ.get("CUDA_HOME", "/usr/local/cuda"))
        nccl = self.conf.get("user.ddp:nccl_root", default=os.environ.get("NCCL_ROOT", cuda))
        return cuda, nccl

    def validate(self):
        check_min_cppstd(self, 20)
        if self.options.with_nccl:
            cuda, nccl = self._cuda_roots()
            if not os.path.exists(os.path.join(nccl, "include", "nccl.h")):
                raise ConanInvalidConfiguration(
                    f"ddp/*:with_nccl=True needs nccl.h under {nccl}/include: "
                    "set -c user.ddp:nccl_root=<dir> (or NCCL_ROOT / CUDA_HOME)")

    def package_info(self):
        # Targets as the CMake install names them: ddp::ddp (the headers), ddp::mpi, ddp::nccl;
        # ddp::all links every component this configuration has.
        self.cpp_info.set_property("cmake_file_name", "ddp")
        self.cpp_info.set_property("cmake_target_name", "ddp::all")
        self.cpp_info.set_property("pkg_config_name", "ddp")
        core = self.cpp_info.components["core"]
        core.set_property("cmake_target_name", "ddp::ddp")
        core.bindirs = []
        core.libdirs = []
        if self.settings.os in ("Linux", "FreeBSD"):
            core.system_libs = ["pthread", "rt"]
        if self.options.with_mpi:
            mpi = self.cpp_info.components["mpi"]
            mpi.set_property("cmake_target_name", "ddp::mpi")
            mpi.requires = ["core"]
            PkgConfig(self, "mpi-cxx").fill_cpp_info(mpi, is_system=True)  # sets defines: ours after
            mpi.defines = mpi.defines + ["DDP_HAS_MPI=1"]
            mpi.bindirs = []
        if self.options.with_nccl:
            cuda, nccl = self._cuda_roots()
            nccl_component = self.cpp_info.components["nccl"]
            nccl_component.set_property("cmake_target_name", "ddp::nccl")
            nccl_component.requires = ["core"]
            nccl_component.defines = ["DDP_HAS_CUDA=1", "DDP_HAS_NCCL=1"]
            nccl_component.bindirs = []
            nccl_component.includedirs = sorted({os.path.join(cuda, "include"), os.path.join(nccl, "include")})
            nccl_component.libdirs = sorted({os.path.join(cuda, "lib64"), os.path.join(nccl, "lib64"),
                                             os.path.join(nccl, "lib")})
            nccl_component.system_libs = ["nccl", "cudart"]
        if self.options.with_torch:
            torch = self.cpp_info.components["torch"]
            torch.set_property("cmake_target_name", "ddp::torch")
            torch.requires = ["core"]
            torch.defines = ["DDP_HAS_TORCH=1"]
            torch.bindirs = []
            torch.libdirs = []
        # Modules CMakeDeps includes after the targets exist: libtorch is not a Conan package (the
        # torch module finds the consumer's and links it); ddp::compiled is built by the consumer.
        modules = []
        if self.options.with_torch:
            modules.append(os.path.join("lib", "cmake", "ddp-conan-torch.cmake"))
        if self.options.compiled:
            modules.append(os.path.join("lib", "cmake", "ddp-conan-compiled.cmake"))
        if modules:
            self.cpp_info.set_property("cmake_build_modules", modules)
