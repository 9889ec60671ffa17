"""The installed dependencies fall inside setup.py's ranges, and every range is closed above (a new
major release is untested until someone raises the bound)."""
from importlib import metadata

import pytest
from packaging.requirements import Requirement

REQUIREMENTS = [Requirement(r) for r in metadata.requires("steprl_jax") or []]


def _installed_under(extra: str | None):
    for req in REQUIREMENTS:
        if req.marker is None if extra is None else (req.marker is not None and req.marker.evaluate({"extra": extra})):
            yield req


def test_the_project_is_installed_with_its_requirements():
    assert len(list(_installed_under(None))) >= 15


@pytest.mark.parametrize("extra", [None, "test"])
def test_installed_versions_are_inside_the_tested_ranges(extra):
    outside = []
    for req in _installed_under(extra):
        version = metadata.version(req.name)  # a missing runtime requirement fails here
        if not req.specifier.contains(version, prereleases=True):
            outside.append(f"{req.name} {version} not in {req.specifier}")
    assert not outside, outside


def test_every_runtime_range_is_closed_above():
    open_ended = [str(req) for req in _installed_under(None)
                  if not any(spec.operator in ("<", "<=", "==", "~=") for spec in req.specifier)]
    assert not open_ended, f"add an upper bound (the series tested) to: {open_ended}"
