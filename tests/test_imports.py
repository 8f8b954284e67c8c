"""fleetgen/imports.py: the collector paused over a block, and as it was after it."""

import gc

import pytest

from fleetgen.imports import paused_gc


def test_paused_gc_pauses_the_collector_for_the_block_and_restores_it_as_it_was():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # an inner block does not turn it on under an outer one
    assert gc.isenabled()
    with pytest.raises(ValueError), paused_gc():
        raise ValueError
    assert gc.isenabled()  # after an error too
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()
