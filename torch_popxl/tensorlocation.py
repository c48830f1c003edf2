"""``popxl.tensorlocation``: where tensors live (upstream's enums and ``TensorLocation``)."""

from __future__ import annotations

import enum

__all__ = [
    "TensorStorage",
    "ReplicatedTensorSharding",
    "TileSet",
    "ExecutionContext",
    "TensorLocation",
]


class TensorStorage(enum.Enum):
    """On-chip tile memory or off-chip Streaming Memory."""

    OnChip = "OnChip"
    OffChip = "OffChip"


class ReplicatedTensorSharding(enum.Enum):
    """Whether a tensor is sharded over replicas."""

    On = "On"
    Off = "Off"


class TileSet(enum.Enum):
    """The tiles an op runs on: compute tiles or IO tiles."""

    Compute = 0
    IO = 1
    Undefined = 2


class ExecutionContext(enum.Enum):
    """The part of the program an op belongs to."""

    Normal = 0
    AccumulateOuterFragment = 1
    WeightsFromHostFragment = 2
    WeightsToHostFragment = 3
    OptimizerFromHostFragment = 4
    Subgraph = 5


class TensorLocation:
    """The memory characteristics of a tensor: its storage and whether it is RTS-sharded."""

    def __init__(
        self,
        storage: TensorStorage = TensorStorage.OnChip,
        replicated_tensor_sharding: ReplicatedTensorSharding = ReplicatedTensorSharding.Off,
    ) -> None:
        if not isinstance(storage, TensorStorage):
            raise TypeError(f"storage must be a TensorStorage; got {storage!r}.")
        if not isinstance(replicated_tensor_sharding, ReplicatedTensorSharding):
            raise TypeError(
                "replicated_tensor_sharding must be a ReplicatedTensorSharding; got "
                f"{replicated_tensor_sharding!r}."
            )
        self._storage = storage
        self._replicated_tensor_sharding = replicated_tensor_sharding

    @property
    def storage(self) -> TensorStorage:
        return self._storage

    @property
    def replicated_tensor_sharding(self) -> ReplicatedTensorSharding:
        return self._replicated_tensor_sharding

    def __eq__(self, other) -> bool:
        return isinstance(other, TensorLocation) and (
            self._storage,
            self._replicated_tensor_sharding,
        ) == (other._storage, other._replicated_tensor_sharding)

    def __hash__(self) -> int:
        return hash((self._storage, self._replicated_tensor_sharding))

    def __repr__(self) -> str:
        return f"TensorLocation({self._storage}, {self._replicated_tensor_sharding})"
