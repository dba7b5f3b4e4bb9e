"""`python -m triton_tlaloc.cli`: the `tlaloc` command."""

import sys

from . import main

sys.exit(main())
