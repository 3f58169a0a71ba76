"""Helpers shared by the test modules (nothing here is a test)."""
