"""tiertrain installs like a library (issue 35, item 2): a license in the repository and in the
package metadata, torch declared as the range the code is tested with (never an exact pin that
would make pip replace a user's CUDA build), and CI's exact versions kept apart in a constraints
file that the README's test command and .ci/run both use."""
from __future__ import annotations

import os
import re
import tomllib

import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_the_license_is_apache_2_0_in_the_repository_and_the_metadata():
    project = _project()
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = open(os.path.join(ROOT, "LICENSE")).read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_torch_is_a_range_holding_the_tested_versions_and_ci_pins_one_inside_it():
    torch_req = next(Requirement(r) for r in _project()["dependencies"] if Requirement(r).name == "torch")
    assert not any(spec.operator in ("==", "===") for spec in torch_req.specifier), torch_req
    installed = Version(torch.__version__.split("+")[0])
    assert installed in torch_req.specifier and Version("2.11.0") in torch_req.specifier, torch_req
    constraints = open(os.path.join(ROOT, ".ci", "constraints.txt")).read()
    pinned = re.search(r"^torch==(\S+)$", constraints, re.M)
    assert pinned and Version(pinned.group(1)) in torch_req.specifier


def test_ci_runs_the_readme_test_command_with_the_constraints():
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = re.search(r"^(pip install .*-c \.ci/constraints\.txt.*pytest -q)", readme, re.M)
    assert command, "the README's test command installs with .ci/constraints.txt"
    assert command.group(1) in open(os.path.join(ROOT, ".ci", "run")).read()
    assert os.path.exists(os.path.join(ROOT, "CHANGELOG.md"))
