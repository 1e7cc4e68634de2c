"""Shared fixtures of the whole test suite."""

import pytest


@pytest.fixture(autouse=True)
def _no_calibrated_profile(tmp_path_factory, monkeypatch):
    """Point profile lookup at an empty folder, so no test depends on (or is changed by) a
    `meshplan calibrate` profile that happens to exist on the machine."""
    monkeypatch.setenv("MESHPLAN_PROFILE_DIR", str(tmp_path_factory.mktemp("profiles")))
