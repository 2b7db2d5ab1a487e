"""Errors a user can cause. The CLI prints them as one line and exits non-zero."""


class SpecPrefillError(Exception):
    """A problem with the user's input or environment; the message names the fix."""
