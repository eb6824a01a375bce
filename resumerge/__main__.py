"""``python -m resumerge`` runs the CLI."""

import sys

from resumerge.cli.commands import main

sys.exit(main())
