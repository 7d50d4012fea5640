"""The base every error of the store shares: ``except StoreError`` catches what the store
raises (an unreachable or full database, a claim not held, a job or server it has no word
of, ids registered elsewhere, a bad URL), as ``ComfyError`` does for ComfyUI's.

Each error keeps the builtin base that says its kind too (``ClaimLost`` is a
``RuntimeError``, ``UnknownJob`` a ``LookupError``...), so code catching those still does.
"""


class StoreError(Exception):
    """Something the result store could not do; the subclass says what."""
