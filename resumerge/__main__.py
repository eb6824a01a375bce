"""``python -m resumerge`` runs the CLI."""

from resumerge.cli.commands import entry

entry()
