"""`python -m fleetgen ...` is `fleetgen ...`."""

import sys

from fleetgen.jobs.cli import main

sys.exit(main())
