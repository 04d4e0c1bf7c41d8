"""`python -m lucebox`: see lucebox.cli."""

import sys

from lucebox.cli import main

sys.exit(main())
