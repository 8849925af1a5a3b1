"""Errors that are the user's to fix (a bad file, a bad name, a bad option), not bugs.

The command line prints their message and exits with status 2, without a traceback; assets
turn them into a step failure whose message is the same text.
"""


class UserInputError(ValueError):
    """A mistake in what the user gave us; the message says what and where, and how to fix it."""
