"""The error raised for every bad data setting."""


class DataError(ValueError):
    """A data setting (``--data``, ``--data_dir``, a split, a batch shape) is invalid.

    The message is one line naming the setting and what is allowed.
    """
