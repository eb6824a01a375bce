"""Tests of resumerge.hub against a stand-in hub on 127.0.0.1."""
