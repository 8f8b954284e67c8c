"""`python -m fleetgen ...` is `fleetgen ...`."""

import sys

from fleetgen.cli import main

sys.exit(main())
