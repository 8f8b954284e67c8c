"""The reference pages of the docs are what the code's tables render (fleetgen/jobs/reference.py):
a changed option, field or family entry fails here until `make docs` writes the pages again."""

from pathlib import Path

import pytest

from fleetgen.jobs import reference

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference"


@pytest.mark.parametrize("page", sorted(reference.PAGES))
def test_a_reference_page_is_what_the_code_renders(page):
    assert (DOCS / page).read_text() == reference.PAGES[page](), (
        f"docs/reference/{page} is out of date: run `make docs` (or `python -m fleetgen.jobs.reference docs/reference`)"
    )


def test_every_option_field_and_family_is_on_its_page():
    """The pages render every entry of their tables (not a hand-kept subset)."""
    from fleetgen.cli import _parser
    from fleetgen.workers.families.table import TABLE
    from fleetgen.workers.output.fields import records

    run = _parser()._subparsers._group_actions[0].choices["run"]
    options = reference.options_page()
    assert all(f"`{o}`" in options for a in run._actions[1:] for o in a.option_strings)
    columns = reference.columns_page()
    assert all(f"| `{f.name}` |" in columns for f in records())
    families = reference.families_page()
    assert all(f"| `{f.name}` |" in families for f in TABLE)
