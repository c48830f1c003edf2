"""Remote variables and replicated tensor sharding (spec §4.4-§4.8): host transfers."""

from __future__ import annotations

__all__ = ["upload_remote_variables", "download_remote_variables"]


def upload_remote_variables(session) -> None:
    """Write every remote variable's host data into its buffer slot on every replica."""
    for v in session.ir._all_variables:
        if getattr(v, "_remote", None) is not None:
            raise NotImplementedError("remote variables are not implemented yet")


def download_remote_variables(session) -> None:
    """Read every remote variable back from its buffer slot into the host copy."""


def remote_variable(*args, **kwargs):
    raise NotImplementedError("remote_variable is not implemented yet")


def remote_replica_sharded_variable(*args, **kwargs):
    raise NotImplementedError("remote_replica_sharded_variable is not implemented yet")


def replica_sharded_buffer(*args, **kwargs):
    raise NotImplementedError("replica_sharded_buffer is not implemented yet")


def replica_sharded_variable(*args, **kwargs):
    raise NotImplementedError("replica_sharded_variable is not implemented yet")
