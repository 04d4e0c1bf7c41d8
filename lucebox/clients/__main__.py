"""`python -m lucebox.clients install|run|probe`: the same as `python -m lucebox clients ...`."""

import sys

from lucebox.cli import main

sys.exit(main(["clients", *sys.argv[1:]]))
