"""Exceptions shared by the scheduler, the workers and the clients.

Both are ``ValueError`` subclasses so that msgspec, which wraps ``ValueError``
raised from a struct's ``__post_init__`` into ``msgspec.ValidationError`` while
decoding, treats them as ordinary validation failures.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is missing, malformed or out of range.

    The message names the field (or file / environment variable) and the problem,
    e.g. ``"block_size: must be a power of two between 1 and 256, got 3"``.
    ``field`` and ``source`` carry the same facts for programs that want them.
    """

    def __init__(
        self, message: str, *, field: str | None = None, source: str | None = None
    ) -> None:
        super().__init__(message)
        self.field = field
        self.source = source


class InvalidRequestError(ValueError):
    """A request (or its sampling parameters) carries bad data.

    The message names the offending field, e.g. ``"top_p: must be in (0, 1], got 0.0"``;
    ``field`` holds that name when it is known.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
