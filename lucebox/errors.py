"""Errors whose message is meant for the user.

Anything raised as a `LuceboxError` is shown as one line (CLI: exit code 2, no
traceback; HTTP: a 4xx in the dialect's error shape). Everything else is a bug.
"""


class LuceboxError(Exception):
    """A problem the user can fix; the message names it in one line."""


class ModelFileError(LuceboxError):
    """A model file is missing, truncated, corrupt or of an unsupported kind."""


class FetchError(LuceboxError):
    """A model could not be downloaded or failed its checksum."""
