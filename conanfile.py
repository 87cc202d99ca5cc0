import os

from conan import ConanFile
from conan.tools.build import check_min_cppstd
from conan.tools.files import copy
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
    exports_sources = "include/*", "LICENSE"
    no_copy_source = True

    def layout(self):
        basic_layout(self, src_folder=".")

    def validate(self):
        check_min_cppstd(self, 20)

    def package_id(self):
        self.info.clear()  # the same headers for every configuration

    def package(self):
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        copy(self, "*.hpp", os.path.join(self.source_folder, "include"),
             os.path.join(self.package_folder, "include"))

    def package_info(self):
        self.cpp_info.set_property("cmake_file_name", "ddp")
        self.cpp_info.set_property("cmake_target_name", "ddp::ddp")
        self.cpp_info.set_property("pkg_config_name", "ddp")
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        if self.settings.os in ("Linux", "FreeBSD"):
            self.cpp_info.system_libs = ["pthread", "rt"]
