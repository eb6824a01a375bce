"""The version of resumerge, recorded in every plan, ledger and manifest it writes."""

__version__ = "0.6.0"
