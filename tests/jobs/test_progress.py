import io
import time

from fleetgen.jobs.progress import Progress


def test_plain_lines_when_not_a_tty():
    out = io.StringIO()
    p = Progress(shards_total=4, rows_total=40, shards_done=1, rows_done=10, stream=out, interval=0)
    p.start_clock()
    time.sleep(0.05)
    p.update(images=10, rows=10)
    p.update(shards=1, errors=2, rows=2)
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in out.getvalue()
    assert lines[-1].startswith("[fleetgen] shards 2/4  rows 22/40  ")
    assert "img/s  ETA " in lines[-1] and lines[-1].endswith("(2 row errors, 0 shards failed)")


def test_plain_lines_are_rate_limited():
    out = io.StringIO()
    p = Progress(shards_total=100, rows_total=100, stream=out, interval=3600)
    for _ in range(50):
        p.update(images=1, rows=1)
    assert len(out.getvalue().splitlines()) == 1  # only the first update draws within the interval


def test_bar_redraws_in_place_on_a_tty():
    out = io.StringIO()
    p = Progress(shards_total=2, rows_total=8, stream=out, tty=True)
    p.update(images=4, rows=4)
    p.log("w0 ready")
    p.close()
    text = out.getvalue()
    assert text.startswith("\r[############............] shards 0/2  rows 4/8")
    assert "\r\x1b[K[fleetgen] w0 ready\n" in text
    assert text.endswith("\x1b[K\n")
