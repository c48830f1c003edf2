"""The cost model: turns one run's traffic and FLOPs into an estimated device step time."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CostModel", "TRAFFIC_KINDS"]

TRAFFIC_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "local_slice",
    "remote_load",
    "remote_store",
    "host_to_device",
    "device_to_host",
)
_COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "local_slice")


@dataclass(frozen=True)
class CostModel:
    """Rates that turn one run's traffic and matmul FLOPs into an estimated step time.

    Every rate is per replica: replicas run in parallel, so a replica's time is its share of
    the bytes (total / R) over the rate. Phases are added with no overlap, so the estimate is
    an upper bound of a perfectly scheduled step.

    Defaults (rough IPU-POD figures):

    * ``replica_link_bytes_per_s`` 64 GB/s: IPU-Link bandwidth a replica gets for collectives.
    * ``streaming_memory_bytes_per_s`` 8 GB/s: remote loads and stores; the seeds put streaming
      memory 3x to 20x below the replica links, 8x here.
    * ``host_bytes_per_s`` 8 GB/s: host streams (PCIe / gateway).
    * ``flops_per_s`` 60 TFLOP/s: matmul throughput (aten.mm / addmm / bmm / baddbmm / mv / dot).
    """

    replica_link_bytes_per_s: float = 64e9
    streaming_memory_bytes_per_s: float = 8e9
    host_bytes_per_s: float = 8e9
    flops_per_s: float = 60e12

    def __post_init__(self):
        for name in ("replica_link_bytes_per_s", "streaming_memory_bytes_per_s",
                     "host_bytes_per_s", "flops_per_s"):  # fmt: skip
            value = getattr(self, name)
            if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
                raise ValueError(
                    f"CostModel.{name} must be a positive finite number; got {value!r}."
                )

    def breakdown(
        self, traffic: Mapping[str, int], flops: int, num_replicas: int
    ) -> dict[str, float]:
        """Seconds per phase of one run: compute, replica_links, streaming_memory, host_io."""
        per_replica = {k: v / num_replicas for k, v in traffic.items()}
        links = sum(per_replica.get(k, 0) for k in _COLLECTIVE_KINDS)
        remote = per_replica.get("remote_load", 0) + per_replica.get("remote_store", 0)
        host = per_replica.get("host_to_device", 0) + per_replica.get("device_to_host", 0)
        return {
            "compute": flops / self.flops_per_s,
            "replica_links": links / self.replica_link_bytes_per_s,
            "streaming_memory": remote / self.streaming_memory_bytes_per_s,
            "host_io": host / self.host_bytes_per_s,
        }
