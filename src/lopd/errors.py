"""User-facing errors: each message is one line naming the bad file, line, key or value.

The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
"""


class LopdError(Exception):
    pass


class ConfigError(LopdError, ValueError):
    """A bad config file, key or value."""


class DataError(LopdError, ValueError):
    """A malformed data file or row."""


class ModelNotFound(LopdError, FileNotFoundError):
    """A model name that is neither bundled nor a folder holding a model."""


class EnvError(LopdError):
    """An env method that raised, or returned something the loop cannot use (a non-finite reward, no Score):
    the message names the method, the task and what happened."""
