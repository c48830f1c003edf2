"""Layers of popxl-addons: ``Embedding``, ``LayerNorm``, ``GroupNorm``, ``Linear``, ``Conv2D``."""

from .conv import Conv2D
from .embedding import Embedding
from .group_norm import GroupNorm
from .layer_norm import LayerNorm
from .linear import Linear

__all__ = ["Conv2D", "Embedding", "GroupNorm", "LayerNorm", "Linear"]
