"""Helpers the tests share (imported as ``support.*``: tests/ is on sys.path)."""
