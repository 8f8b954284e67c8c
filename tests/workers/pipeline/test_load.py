"""workers/pipeline/load.py: the pipeline libraries' warnings, once per worker and job."""

import logging

from fleetgen.workers.pipeline.load import _ONCE, warnings_once


def said(text: str) -> str | None:
    """What a diffusers warning becomes through the filter; None when it is held back."""
    record = logging.LogRecord("diffusers.pipelines", logging.WARNING, __file__, 1, text, (), None)
    return record.getMessage() if _ONCE.filter(record) else None


def test_a_librarys_warning_is_said_once_per_worker_and_job():
    warnings_once("w0")
    assert said("Guidance scale 4.0 is ignored.") == "[fleetgen] w0: diffusers says: Guidance scale 4.0 is ignored."
    assert said("Guidance scale 4.0 is ignored.") is None  # the job's next call
    assert said("another") == "[fleetgen] w0: diffusers says: another"
    warnings_once("w1")  # the next job's load in the same process (a parked worker, cluster/warm.py)
    assert said("Guidance scale 4.0 is ignored.") == "[fleetgen] w1: diffusers says: Guidance scale 4.0 is ignored."
