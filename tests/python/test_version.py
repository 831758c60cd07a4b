"""ferry.__version__ is the one version, core/version.h's (which CMake and pyproject.toml read too)."""

import pathlib
import re

import ferry


def test_version_is_core_version_h():
    header = pathlib.Path(__file__).resolve().parents[2] / "core" / "version.h"
    expected = re.search(r'kVersion = "([0-9.]+)"', header.read_text()).group(1)
    assert ferry.__version__ == expected
