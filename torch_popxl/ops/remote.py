"""``remote_load``, ``remote_load_``, ``remote_store`` (spec §4.3): re-exported from their op
stanza, ``torch_popxl/opdefs/remote.py``."""

from __future__ import annotations

from ..opdefs.remote import remote_load, remote_load_, remote_store

__all__ = ["remote_load", "remote_load_", "remote_store"]
