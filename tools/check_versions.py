#!/usr/bin/env python3
"""Checks that every place that states ddp's version agrees with include/ddp/version.hpp."""
import json
import pathlib
import re
import sys

root = pathlib.Path(__file__).resolve().parent.parent
text = (root / "include/ddp/version.hpp").read_text()
version = ".".join(re.search(rf"#define DDP_VERSION_{p} (\d+)", text).group(1)
                   for p in ("MAJOR", "MINOR", "PATCH"))
found = {
    "meson.build": re.search(r"version:\s*'([^']+)'", (root / "meson.build").read_text()).group(1),
    "conanfile.py": re.search(r'^\s+version = "([^"]+)"', (root / "conanfile.py").read_text(), re.M).group(1),
    "ports/ddp/vcpkg.json": json.loads((root / "ports/ddp/vcpkg.json").read_text())["version-semver"],
    "CHANGELOG.md": re.search(r"^## \[?(\d+\.\d+\.\d+)", (root / "CHANGELOG.md").read_text(), re.M).group(1),
}
bad = {k: v for k, v in found.items() if v != version}
# meson.build lists the core area's test sources by hand: the same as ddp-test-core (and main.cpp)
# in tests/CMakeLists.txt.
meson = (root / "meson.build").read_text()
cmake = (root / "tests/CMakeLists.txt").read_text()
core = re.search(r"ddp_unit_test\(ddp-test-core \w+([^)]*)\)", cmake).group(1).split()
for source in ["unit/main.cpp"] + core:
    if f"'tests/{source}'" not in meson:
        bad[f"meson.build (unit_sources lacks tests/{source}, a source of ddp-test-core)"] = "missing"
listed = re.findall(r"'tests/unit/([a-z_/]+\.cpp)'", meson)
for name in listed:
    if f"unit/{name}" not in core + ["unit/main.cpp"]:
        bad[f"meson.build (tests/unit/{name} is not a source of ddp-test-core)"] = "extra"
for k, v in bad.items():
    print(f"{k} says {v}, include/ddp/version.hpp says {version}", file=sys.stderr)
if not bad:
    print(f"all versions agree: {version}")
sys.exit(1 if bad else 0)
