"""Dagster-free core library: everything the assets call, testable on its own."""
