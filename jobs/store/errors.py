"""What can go wrong with a store, as exceptions a caller can act on.

Messages name the bucket and the endpoint so the user knows where to look, and never carry credentials.
"""


class StoreError(Exception):
    """Base of every store failure."""


class ObjectNotFound(StoreError):
    """The key does not exist (yet)."""


class StoreAccessError(StoreError):
    """A permanent failure: credentials rejected, bucket missing, endpoint unreachable. Retrying will not help."""


class TransientStoreError(StoreError):
    """The store failed in a way that may pass (5xx, timeout, reset) and kept failing after every retry."""


class VersionNotPublished(StoreError):
    """A published directory has no manifest yet, so it does not exist as far as readers are concerned."""


class IntegrityError(StoreError):
    """A downloaded file does not match the size or sha256 its manifest records."""
