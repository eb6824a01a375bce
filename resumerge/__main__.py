"""``python -m resumerge`` runs the CLI."""

import sys

from resumerge.cli import main

sys.exit(main())
