"""`make test`'s two pytest workers keep the tests with Ray heads of their own together, and those on
the session's Ray together, as tests/conftest.py asks: checked in a pytest run of its own with the installed pytest and xdist
(pytest 9.2 made xdist's groups silently hold nothing: pytest-xdist#1386)."""

from tests.conftest import inner_pytest

GROUPED, ON_RAY, LOOSE = 12, 12, 12


def test_the_tests_marked_cluster_run_on_one_pytest_worker_those_on_ray_on_one_and_the_rest_on_both(tmp_path):
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\naddopts = --strict-markers -p no:cacheprovider\nmarkers =\n"
        "    cluster: starts Ray heads of its own\n    ray: uses the session's Ray\n    xdist_group: xdist's group\n"
    )
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "test_inner.py").write_text(
        "import os, time\nimport pytest\n\n"
        "def _ran(name):\n"
        "    time.sleep(0.05)\n"
        f"    open({str(tmp_path / 'ran')!r} + '-' + name, 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n\n"
        "@pytest.mark.cluster\n@pytest.mark.parametrize('i', range(%d))\n"
        "def test_grouped(i):\n    _ran(f'grouped{i}')\n\n"
        "@pytest.mark.ray\n@pytest.mark.parametrize('i', range(%d))\n"
        "def test_on_ray(i):\n    _ran(f'ray{i}')\n\n"
        "@pytest.mark.parametrize('i', range(%d))\n"
        "def test_loose(i):\n    _ran(f'loose{i}')\n" % (GROUPED, ON_RAY, LOOSE)
    )
    inner_pytest(tmp_path, "--dist", "loadgroup")
    ran = {p.name.split("-", 1)[1]: p.read_text() for p in tmp_path.glob("ran-*")}
    assert len(ran) == GROUPED + ON_RAY + LOOSE
    grouped = {w for name, w in ran.items() if name.startswith("grouped")}
    assert len(grouped) == 1, f"the tests marked cluster ran on {sorted(grouped)}: xdist's groups do not hold"
    on_ray = {w for name, w in ran.items() if name.startswith("ray")}
    assert len(on_ray) == 1, f"the tests on the session's Ray ran on {sorted(on_ray)}"
    assert set(ran.values()) == {"gw0", "gw1"}  # and there were two workers to choose from
