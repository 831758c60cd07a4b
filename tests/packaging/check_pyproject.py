"""pyproject.toml against the CMake build: the version scikit-build-core will read from core/version.h is the
one CMake read (argv[1]), and the package, targets and install component it names exist."""

import pathlib
import re
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11
    print("needs tomllib (Python 3.11)")
    sys.exit(77)

root = pathlib.Path(__file__).resolve().parents[2]
expected = sys.argv[1]
config = tomllib.loads((root / "pyproject.toml").read_text())

assert config["build-system"]["build-backend"] == "scikit_build_core.build"
assert "version" in config["project"]["dynamic"], "the version must come from core/version.h"
skbuild = config["tool"]["scikit-build"]
version = skbuild["metadata"]["version"]
assert version["provider"] == "scikit_build_core.metadata.regex"
match = re.search(version["regex"], (root / version["input"]).read_text())
assert match, f"{version['regex']!r} finds nothing in {version['input']}"
assert match.group("value") == expected, f"pyproject reads {match.group('value')}, CMake {expected}"

for package in skbuild["wheel"]["packages"]:
    assert (root / package / "__init__.py").is_file(), package
install = (root / "cmake" / "FerryInstall.cmake").read_text()
for component in skbuild["install"]["components"]:
    assert f"COMPONENT {component}" in install, component
for target in skbuild["build"]["targets"]:
    assert re.search(rf"\b(add_executable|ferry_executable|pybind11_add_module)\({target}\b",
                     "".join(p.read_text() for p in root.glob("*/CMakeLists.txt"))), target
print(f"pyproject.toml: version {expected}, packages {skbuild['wheel']['packages']}")
