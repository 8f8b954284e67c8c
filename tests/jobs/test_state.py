"""jobs/state.py: what job.json records about the job's makers."""

from fleetgen.jobs import state


def test_versions_are_the_installed_packages_own_and_a_package_without_metadata_is_none():
    """job.json's versions come from package metadata (a driver never imports torch or diffusers): they
    are the versions the modules report, and a package installed without metadata reads as None."""
    import diffusers
    import torch

    recorded = state.versions()
    assert recorded["torch"] == str(torch.__version__) and recorded["diffusers"] == diffusers.__version__
    assert state._installed("fleetgen-no-such-package") is None
