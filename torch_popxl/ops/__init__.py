"""``popxl.ops``: PopXL's op names as thin wrappers over captured torch functions.

Each op checks its PopXL-specific arguments, then runs the torch function on the handles;
the capture layer records the aten ops, so shapes and dtypes come from torch itself.

The ops live in one module per family and this module re-exports them:
``elementwise`` (arithmetic, comparisons, activations, in-place variants), ``shape``
(reshape, transpose, concat, split, cast), ``indexing`` (slicing, gathers, one-hot, dynamic
slices, scatter), ``reductions`` (every reduction over axes through one implementation, Note
[one reduction]; arg-reductions, cumsum, histogram), ``nn`` (matmul, norms, dropout, pooling,
convolution), ``losses``, ``resize`` (interpolate, roi_align), ``rng`` (random numbers and
seeds), ``program`` (print_tensor, remote_code_load), ``var_updates``, ``collectives``,
``call`` / ``conditional``, ``addons_needs``; host and remote transfers and ``ipu_copy`` come
from their op stanzas in ``opdefs/``. A family module imports only ``_common`` and the
families it builds on (losses on reductions on shape), never this package.
"""

from __future__ import annotations

from ..opdefs.host import host_load, host_store
from ..opdefs.ipu_copy import ipu_copy
from . import addons_needs, collectives, var_updates
from .addons_needs import *  # noqa: F403  (issue 15: names popxl-addons programs use)
from .call import CallSiteInfo, call, call_with_info, repeat, repeat_with_info
from .conditional import conditional, conditional_with_info
from .elementwise import (
    abs,
    add,
    add_,
    ceil,
    clip,
    cos,
    div,
    equal,
    exp,
    exp_,
    floor,
    fmod,
    gelu,
    gelu_,
    geluerf,
    greater,
    identity,
    increment_mod,
    increment_mod_,
    io_tile_copy,
    isfinite,
    isinf,
    isnan,
    less,
    log,
    log_softmax,
    logical_and,
    logical_not,
    logical_or,
    max,
    maximum,
    min,
    minimum,
    mul,
    neg,
    negate,
    pow,
    relu,
    relu_,
    sigmoid,
    sign,
    sin,
    softmax,
    sqrt,
    sub,
    swish,
    tanh,
    where,
)
from .indexing import (
    dynamic_slice,
    dynamic_update,
    dynamic_update_,
    gather,
    onehot,
    scatter,
    slice,
    slice_,
    subsample,
    tied_gather,
)
from .losses import nll_loss, nll_loss_with_softmax_grad
from .nn import (
    PadType,
    average_pool,
    batch_norm_inference,
    conv,
    conv_transpose,
    dropout,
    group_norm,
    layer_norm,
    matmul,
    max_pool,
)
from .program import print_tensor, remote_code_load
from .reductions import (
    argmax,
    argmin,
    cumsum,
    histogram,
    l1,
    l2,
    logsum,
    logsumexp,
    mean,
    median,
    prod,
    reduce_max,
    reduce_mean,
    reduce_median,
    reduce_min,
    reduce_prod,
    reduce_sum,
    reduce_sum_square,
    sum,
    sumsquare,
    topk,
)
from .remote import remote_load, remote_load_, remote_store
from .resize import interpolate, roi_align
from .rng import create_random_seed, random_normal, random_uniform, split_random_seed
from .shape import (
    cast,
    concat,
    concat_,
    detach,
    detach_,
    flatten,
    flatten_,
    init,
    reshape,
    reshape_,
    split,
    squeeze,
    transpose,
    transpose_,
    unsqueeze,
)
from .var_updates import (
    accumulate_,
    accumulate_mean_,
    accumulate_moving_average_,
    accumulate_moving_average_square_,
    accumulate_square_,
    accumulator_scale_,
    accumulator_zero_,
    adam_updater,
    adam_var_update,
    adamax_updater,
    copy_var_update_,
    lamb_square,
    lamb_updater,
    scaled_add,
    scaled_add_,
    sparse_accumulate_,
)

__all__ = [
    # elementwise
    "add", "sub", "mul", "div", "neg", "negate", "abs", "exp", "log", "sqrt", "pow", "fmod",
    "relu", "gelu", "tanh", "sigmoid", "swish", "softmax", "log_softmax", "cos", "sin",
    "logical_and", "logical_or", "logical_not", "equal", "greater", "less", "where",
    "max", "min", "maximum", "minimum", "increment_mod", "clip",
    # linear algebra and shape
    "matmul", "reshape", "reshape_", "transpose", "transpose_", "flatten", "flatten_",
    "slice", "subsample", "concat", "split", "squeeze", "unsqueeze", "cast", "detach",
    "gather", "onehot", "argmax", "argmin", "topk", "layer_norm", "dropout", "ipu_copy",
    "init",
    # reductions
    "reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod",
    "reduce_sum_square", "reduce_median",
    # losses
    "nll_loss", "nll_loss_with_softmax_grad",
    # host io, remote, calls
    "host_load", "host_store", "remote_load", "remote_load_", "remote_store",
    "call", "call_with_info", "repeat", "repeat_with_info", "CallSiteInfo", "print_tensor",
    "conditional", "conditional_with_info",
    # var updates
    "accumulate_", "accumulate_square_", "accumulate_mean_", "accumulate_moving_average_",
    "accumulate_moving_average_square_", "accumulator_scale_", "accumulator_zero_",
    "copy_var_update_", "sparse_accumulate_", "adam_updater", "adam_var_update",
    "lamb_square", "scaled_add", "scaled_add_",
    "collectives", "var_updates", "lamb_updater", "adamax_updater",
    # upstream's other op names, slice_ and tied_gather
    "add_", "relu_", "gelu_", "exp_", "concat_", "detach_", "increment_mod_", "identity", "io_tile_copy", "ceil", "floor", "sign", "isfinite", "isinf", "isnan", "geluerf", "cumsum", "histogram", "mean", "sum", "sumsquare", "prod", "median", "l1", "l2", "logsum", "logsumexp", "group_norm", "batch_norm_inference", "average_pool", "max_pool", "conv", "conv_transpose", "PadType", "dynamic_slice", "dynamic_update", "dynamic_update_", "scatter", "random_uniform", "random_normal", "split_random_seed", "create_random_seed", "remote_code_load", "interpolate", "roi_align", "slice_", "tied_gather",
]  # fmt: skip

__all__ += addons_needs.__all__  # noqa: F405  (issue 15: re-exported above)
