"""Resampling ops: ``interpolate`` (ONNX Resize, as upstream) and ``roi_align`` (ONNX RoiAlign-10).
Both compute their sampling positions and weights from the shapes when the graph is built and
record gathers and weighted sums.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..ir.tensor import Tensor
from ._common import _check_tensor, call_op

__all__ = ["interpolate", "roi_align"]


# ---- interpolate --------------------------------------------------------------------------


_NEAREST_ROUNDING: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "round_prefer_floor": lambda x: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x: np.floor(x + 0.5),
    "floor": np.floor,
    "ceil": np.ceil,
}


_RESIZE_MODES = ("nearest", "linear", "cubic")


_RESIZE_COORDINATES = (
    "half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize",
)  # fmt: skip


_CUBIC_A = -0.75  # ONNX Resize's default cubic_coeff_a (also torch's bicubic)


def interpolate(t: Tensor, scale_factor: Sequence[float] = (1.0, 1.0, 1.0, 1.0),
                mode: str = "nearest", nearest_mode: str = "round_prefer_floor",
                coordinate_transformation_mode: str = "half_pixel", *,
                output_size: Sequence[int] | None = None) -> Tensor:  # fmt: skip
    """Resize ``t`` (ONNX Resize, as upstream PopXL): each output axis has
    ``floor(length * scale)`` elements; output index ``i`` reads the source coordinate given by
    ``coordinate_transformation_mode`` (half_pixel ``(i + 0.5) / scale - 0.5``,
    pytorch_half_pixel (0 for a length-1 output), align_corners
    ``i * (length - 1) / (out_length - 1)``, asymmetric ``i / scale``, tf_crop_and_resize with
    the full region), sampled with ``mode`` "nearest" (rounded by ``nearest_mode``), "linear" or
    "cubic" (coefficient -0.75); samples beyond the edges repeat the edge element.

    ``output_size`` (keyword only, not in upstream PopXL) gives the output shape instead of
    ``scale_factor``.
    """
    t = _check_tensor(t, "interpolate")
    if mode not in _RESIZE_MODES:
        raise ValueError(f"interpolate type {mode} is not valid, must be nearest, linear or cubic.")
    if nearest_mode not in _NEAREST_ROUNDING:
        raise ValueError(
            f"interpolate type {nearest_mode} is not valid, must be round_prefer_floor, "
            "round_prefer_ceil, floor or ceil."
        )
    if coordinate_transformation_mode not in _RESIZE_COORDINATES:
        raise ValueError(
            f"interpolate type {coordinate_transformation_mode} is not valid, must be "
            "half_pixel, pytorch_half_pixel, align_corners, asymmetric or tf_crop_and_resize."
        )
    if mode != "nearest" and not t.dtype.is_floating_point:
        raise TypeError(
            f"interpolate: mode={mode!r} needs a floating-point tensor; {t.id!r} is "
            f"{t.dtype.name}. Cast it first, or use mode='nearest'."
        )
    if output_size is not None:
        sizes = [int(s) for s in output_size]
        if len(sizes) != t.rank or builtins.min(sizes, default=1) < 1:
            raise ValueError(
                f"interpolate: output_size needs {t.rank} positive values (one per axis of "
                f"{t.id!r}); got {list(output_size)}."
            )
        scales = [o / i for o, i in zip(sizes, t.shape, strict=True)]
    else:
        scales = [float(s) for s in scale_factor]
        if len(scales) != t.rank:
            raise ValueError(
                f"interpolate: scale_factor needs {t.rank} values (one per axis of {t.id!r}); "
                f"got {scales}."
            )
        if builtins.min(scales, default=1.0) <= 0:
            raise ValueError(f"interpolate: scale_factor values must be positive; got {scales}.")
        sizes = [math.floor(i * s) for i, s in zip(t.shape, scales, strict=True)]
        if 0 in sizes and t.nelms:
            raise ValueError(
                f"interpolate: scale_factor {scales} gives an empty output shape {sizes} for "
                f"{t.id!r} of shape {t.shape}."
            )
    # Per axis: source indices and weights, computed here in float64 (they depend only on the
    # shapes) and applied as gathers plus a weighted sum; resize is separable per axis.
    plan = []
    for ax, (length, size, scale) in enumerate(zip(t.shape, sizes, scales, strict=True)):
        src = _resize_source(coordinate_transformation_mode, length, size, scale)
        taps = _resize_taps(mode, nearest_mode, src, length)
        if len(taps) == 1 and size == length and np.array_equal(taps[0][0], np.arange(length)):
            continue
        plan.append((ax, taps))

    def run(x):
        for ax, taps in plan:
            shape = [1] * x.dim()
            shape[ax] = -1
            total = None
            for idx, weight in taps:
                picked = x.index_select(ax, torch.from_numpy(idx).to(x.device))
                if weight is not None:
                    w = torch.from_numpy(weight).to(device=x.device, dtype=x.dtype)
                    picked = picked * w.reshape(shape)
                total = picked if total is None else total + picked
            x = total
        return x

    return call_op(run, (t,), {})


def _resize_source(ctm: str, length: int, size: int, scale: float) -> np.ndarray:
    # float32 arithmetic in torch's order (reciprocal scale times the shifted index), so linear
    # weights round as torch.nn.functional.interpolate's do
    f32 = np.float32
    i = np.arange(size, dtype=f32)
    if ctm in ("half_pixel", "pytorch_half_pixel"):
        src = f32(1.0 / scale) * (i + f32(0.5)) - f32(0.5)
        return src if size > 1 or ctm == "half_pixel" else np.zeros(size, f32)
    if ctm == "asymmetric":
        return f32(1.0 / scale) * i
    corners = f32((length - 1) / (size - 1)) * i if size > 1 else np.zeros(size, f32)
    if ctm == "align_corners" or size > 1:
        return corners
    # tf_crop_and_resize over the whole region (upstream PopXL passes no roi)
    return np.full(size, 0.5 * (length - 1), f32)


def _resize_taps(mode: str, nearest_mode: str, src: np.ndarray, length: int):
    """[(source indices, weights or None)] whose weighted sum gives each output element;
    indices beyond the input repeat the edge element."""

    def clamp(idx):
        return np.clip(idx, 0, length - 1).astype(np.int64)

    if mode == "nearest":
        return [(clamp(_NEAREST_ROUNDING[nearest_mode](src)), None)]
    base = np.floor(src)
    s = src - base
    if mode == "linear":
        return [(clamp(base), np.float32(1.0) - s), (clamp(base + 1), s)]
    a = _CUBIC_A
    coeffs = [
        ((a * (s + 1) - 5 * a) * (s + 1) + 8 * a) * (s + 1) - 4 * a,
        ((a + 2) * s - (a + 3)) * s * s + 1,
        ((a + 2) * (1 - s) - (a + 3)) * (1 - s) * (1 - s) + 1,
        ((a * (2 - s) - 5 * a) * (2 - s) + 8 * a) * (2 - s) - 4 * a,
    ]
    return [(clamp(base + k - 1), c) for k, c in enumerate(coeffs)]


# ---- region-of-interest pooling -----------------------------------------------------------


def roi_align(t: Tensor, rois: Tensor, batch_index: Tensor, output_size: tuple[int, int],
              spatial_scale: float, sampling_ratio: int) -> Tensor:  # fmt: skip
    """Average-pool each region of interest of ``t`` into ``output_size`` bins (ONNX RoiAlign-10,
    the semantics of ``torchvision.ops.roi_align(..., aligned=False)``).

    ``t`` is ``[N, C, H, W]``; ``rois`` is ``[K, 4]`` boxes ``[x1, y1, x2, y2]`` in image
    coordinates (scaled by ``spatial_scale`` onto ``t``); ``batch_index`` is ``[K]`` integers
    naming each box's image. Each bin averages ``sampling_ratio`` x ``sampling_ratio``
    bilinear samples. Returns ``[K, C, output_size[0], output_size[1]]``.
    """
    t, rois, batch_index = (_check_tensor(x, "roi_align") for x in (t, rois, batch_index))
    if t.rank != 4:
        raise ValueError(f"roi_align: t must be [N, C, H, W]; got shape {t.shape}.")
    if rois.rank != 2 or rois.shape[1] != 4:
        raise ValueError(f"roi_align: rois must be [num_rois, 4] boxes [x1, y1, x2, y2]; got "
                         f"shape {rois.shape}.")  # fmt: skip
    if batch_index.shape != (rois.shape[0],) or not batch_index.dtype.is_int:
        raise ValueError(
            f"roi_align: batch_index must be an integer tensor of shape ({rois.shape[0]},) (one "
            f"image index per box); got {batch_index.dtype.name} {batch_index.shape}."
        )
    size = tuple(output_size)
    if len(size) != 2 or not all(isinstance(s, int) and s > 0 for s in size):
        raise ValueError(f"roi_align: output_size must be two positive ints (height, width); "
                         f"got {output_size!r}.")  # fmt: skip
    if not isinstance(sampling_ratio, int) or sampling_ratio < 1:
        # ONNX's adaptive grid (sampling_ratio 0) depends on each box's size: data-dependent.
        raise ValueError(
            f"roi_align: sampling_ratio must be a positive int (samples per bin side); got "
            f"{sampling_ratio!r}. The adaptive grid of sampling_ratio=0 is not supported."
        )
    scale = float(spatial_scale)

    def run(x, boxes, idx):
        n_h, n_w = size
        feats = x.index_select(0, idx.to(torch.int64))  # [K, C, H, W]
        ay = _roi_interpolation(boxes[:, 1], boxes[:, 3], scale, n_h, sampling_ratio, x.shape[2])
        ax = _roi_interpolation(boxes[:, 0], boxes[:, 2], scale, n_w, sampling_ratio, x.shape[3])
        out = torch.einsum("kph,kchw,kqw->kcpq", ay.to(x.dtype), feats, ax.to(x.dtype))
        return out

    return call_op(run, (t, rois, batch_index), {})


def _roi_interpolation(start, end, scale: float, bins: int, grid: int, extent: int):
    """``[K, bins, extent]`` weights: row ``(k, b)`` averages the 1-D bilinear samples of bin
    ``b`` of box ``k`` along one axis (the 2-D sample weights are products of these)."""
    lo = start.to(torch.float32) * scale
    length = torch.clamp(end.to(torch.float32) * scale - lo, min=1.0)  # legacy: no -0.5 shift
    step = length / bins
    offsets = torch.arange(bins, dtype=torch.float32).reshape(1, bins, 1)
    sub = (torch.arange(grid, dtype=torch.float32).reshape(1, 1, grid) + 0.5) / grid
    pos = lo.reshape(-1, 1, 1) + (offsets + sub) * step.reshape(-1, 1, 1)  # [K, bins, grid]
    # Samples more than one pixel outside the map contribute zero; others clamp to the edge.
    inside = (pos >= -1.0) & (pos <= extent)
    pos = torch.clamp(pos, min=0.0)
    low = torch.clamp(torch.floor(pos), max=extent - 1)
    at_edge = low >= extent - 1
    pos = torch.where(at_edge, low, pos)
    high = torch.where(at_edge, low, low + 1)
    frac = pos - low
    cells = torch.arange(extent, dtype=torch.float32)
    weights = (1 - frac).unsqueeze(-1) * (cells == low.unsqueeze(-1)) + frac.unsqueeze(-1) * (
        cells == high.unsqueeze(-1)
    )
    weights = weights * inside.unsqueeze(-1)
    return weights.sum(2) / grid
