"""Tests of resumerge.inputs.hub against a stand-in hub on 127.0.0.1."""
