"""``Ir`` and graph building: names and ids (spec §0 "Names and ids"), ``create_graph``
argument binding (§7.2), tensor attributes and dtypes (§3), and the Ir's own API (§1).

Names are compared with the strings the spec gives; wherever binding decides which values a
graph computes on, the graph is also called and run and its numbers compared with numpy
(exact, the data are small integers or exactly representable floats).
"""

import typing

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops


def run_main(ir, *tensors):
    """host_store ``tensors`` (already in ``ir.main_graph``) and run once; returns the values."""
    with ir.main_graph:
        streams = [popxl.d2h_stream(t.shape, t.dtype, f"out{i}") for i, t in enumerate(tensors)]
        for s, t in zip(streams, tensors, strict=True):
            ops.host_store(s, t)
    with popxl.Session(ir, executor="reference") as session:
        result = session.run()
    return [result[s] for s in streams]


# ----------------------------------------------------------------------------------------
# Graph ids
# ----------------------------------------------------------------------------------------


class Block(popxl.Module):
    def build(self, x):
        return x * 2.0


class Outer:
    def method(self, x):
        return x + 1.0


def make_inner():
    def inner(x):
        return x - 1.0

    return inner


def top_level(x):
    return x


def body(x):
    k = popxl.constant(1.0, name="k")
    k2 = popxl.constant(1.0, name="k")
    assert (k.id, k2.id) == ("body_subgraph(0)/k", "body_subgraph(0)/k__t1")
    assert (k.name, k.scope) == ("k", "")
    return x + k


def scoped(t):
    with popxl.name_scope("s"):
        return ops.mul(t, 2.0)


def scaled_sum(x, y, scale):
    return x * scale + ops.cast(y, popxl.float32)


def test_subgraph_ids_use_the_qualname_without_locals_and_a_per_ir_counter():
    spec = popxl.TensorSpec((2,), popxl.float32)
    ir = popxl.Ir()
    graphs = [
        ir.create_graph(top_level, spec),
        ir.create_graph(Outer().method, spec),
        ir.create_graph(make_inner(), spec),
        ir.create_graph(Block(), spec),
        ir.create_empty_graph(),
        ir.create_empty_graph("named"),
        ir.create_graph(top_level, spec),
    ]
    assert [g.id for g in graphs] == [
        "top_level_subgraph(0)",
        "Outer.method_subgraph(1)",
        "make_inner.inner_subgraph(2)",
        "Block_subgraph(3)",
        "graph_subgraph(4)",
        "named_subgraph(5)",
        "top_level_subgraph(6)",
    ]
    assert graphs[0] is not graphs[-1]
    assert ir.main_graph.id == "main_graph"
    # The counter belongs to the Ir.
    assert popxl.Ir().create_graph(top_level, spec).id == "top_level_subgraph(0)"


def test_graph_equality_and_construction_rules():
    ir = popxl.Ir()
    g = ir.create_empty_graph()
    assert g == g and not (g == ir.main_graph)
    with pytest.raises(TypeError, match="Graph with int"):
        _ = g == 1
    with pytest.raises(TypeError):
        popxl.Graph()
    # upstream's Graph.main_graph is the Ir's main graph (a Graph), for every graph
    assert g.ir is ir and g.main_graph is ir.main_graph
    assert ir.main_graph.main_graph is ir.main_graph


# ----------------------------------------------------------------------------------------
# Tensor ids and names
# ----------------------------------------------------------------------------------------


def test_tensor_ids_main_graph_unprefixed_subgraph_prefixed_clashes_suffixed():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(1.0, name="w")
        b = popxl.variable(2.0, name="w")
        c = popxl.constant(3.0, name="w")
        assert [t.id for t in (a, b, c)] == ["w", "w__t1", "w__t2"]
        assert [t.name for t in (a, b, c)] == ["w", "w__t1", "w__t2"]
        default = popxl.variable(0.0)
        assert default.id == "t"  # upstream's Graph._create_tensor_id default
        assert popxl.constant(1.0).id == "t__t1"
        g = ir.create_graph(body, a)
        assert [t.id for t in g.inputs] == ["body_subgraph(0)/x"]
        assert g.get_tensor("body_subgraph(0)/k").name == "k"
        assert ir.main_graph.get_tensor("w__t1") == b
        with pytest.raises(ValueError, match="'nope'"):
            g.get_tensor("nope")


def test_name_scope_prefixes_names_and_nests():
    ir = popxl.Ir()
    with ir.main_graph:
        with popxl.name_scope("a"):
            x = popxl.constant(1.0, name="x")
            with popxl.name_scope("b"):
                y = x + 1.0
        z = popxl.constant(2.0, name="x")
        g = ir.create_graph(scoped, x)
    # name drops only the graph prefix; name scopes are part of it (fc1/weight).
    assert (x.id, x.name, x.scope) == ("a/x", "a/x", "a")
    assert (y.id, y.name, y.scope) == ("a/b/add", "a/b/add", "a/b")
    assert (z.id, z.scope) == ("x", "")  # the scope ended with its block
    (out,) = g.outputs
    assert (out.id, out.name, out.scope) == ("scoped_subgraph(0)/s/mul", "s/mul", "s")


def test_stream_default_names_are_unique_and_streams_live_in_the_main_graph():
    ir = popxl.Ir()
    with ir.main_graph:
        first, second = popxl.h2d_stream((1,), popxl.float32), popxl.h2d_stream((1,), popxl.float32)
        d2h = popxl.d2h_stream((1,), popxl.float32)
        named = popxl.h2d_stream((2, 3), popxl.int32, "data")

        def body():
            return ops.host_load(popxl.h2d_stream((1,), popxl.float32, "inside"))

        g = ir.create_graph(body)
    assert [s.tensor_id for s in (first, second, d2h, named)] == [
        "h2d_stream",
        "h2d_stream__t1",
        "d2h_stream",
        "data",
    ]
    assert (named.shape, named.dtype, named.spec) == (
        (2, 3),
        popxl.int32,
        popxl.TensorSpec((2, 3), popxl.int32),
    )
    assert str(named) == "HostToDeviceStream Tensor[data int32 (2, 3)]"
    # Created from inside a subgraph, the stream still belongs to the main graph's Ir.
    assert {s.tensor_id for s in ir.get_all_h2d_streams()} == {"inside"}
    assert g.outputs[0].shape == (1,)
    with pytest.raises(NotImplementedError):
        popxl.HostToDeviceStream()


# ----------------------------------------------------------------------------------------
# create_graph argument binding (spec §7.2)
# ----------------------------------------------------------------------------------------


def test_tensor_and_spec_arguments_become_fresh_inputs_named_after_parameters():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.variable(np.array([1.0, 2.0], np.float32), name="a")
        g = ir.create_graph(scaled_sum, a, popxl.TensorSpec((2,), popxl.int32), 10.0)
        # Only shape/dtype are used: the inputs are new tensors of the subgraph.
        x_in, y_in = g.inputs
        assert (x_in.id, x_in.shape, x_in.dtype) == (
            "scaled_sum_subgraph(0)/x",
            (2,),
            popxl.float32,
        )
        assert (y_in.id, y_in.dtype) == ("scaled_sum_subgraph(0)/y", popxl.int32)
        assert x_in is not a and x_in not in ir.main_graph
        (out,) = ops.call(g, a, popxl.constant(np.array([3, 4], np.int32)))
    (got,) = run_main(ir, out)
    np.testing.assert_array_equal(got, [13.0, 24.0])  # scale=10.0 was passed through


def test_lists_varargs_and_kwargs_become_indexed_and_keyed_inputs_in_signature_order():
    ir = popxl.Ir()
    spec = popxl.TensorSpec((), popxl.float32)

    def fn(first, pair, *rest, flag=False, **named):
        assert flag is True
        assert isinstance(pair, list) and len(pair) == 2
        extra = popxl.graph_input((), popxl.float32, "extra")
        return (
            first
            + pair[0] * 10
            + pair[1] * 100
            + rest[0] * 1000
            + named["last"] * 10000
            + extra * 1e5
        )

    g = ir.create_graph(fn, spec, [spec, spec], spec, flag=True, last=spec)
    assert [t.name for t in g.inputs] == ["first", "pair_0", "pair_1", "rest_0", "last", "extra"]
    with ir.main_graph:
        values = [popxl.constant(float(i + 1)) for i in range(6)]
        (out,) = ops.call(g, *values)
    (got,) = run_main(ir, out)
    assert got == 654321.0


def test_tuple_arguments_stay_tuples_and_dicts_pass_through_untouched():
    ir = popxl.Ir()
    seen = {}

    def fn(xs, options):
        seen["xs"], seen["options"] = xs, options
        return xs[0] + xs[1]

    options = {"a": 1}
    g = ir.create_graph(fn, (popxl.TensorSpec((1,), popxl.float32),) * 2, options)
    assert isinstance(seen["xs"], tuple) and seen["options"] is options
    assert [t.name for t in g.inputs] == ["xs_0", "xs_1"]


def test_defaults_are_applied_and_binding_failures_raise_value_error():
    ir = popxl.Ir()
    spec = popxl.TensorSpec((2,), popxl.float32)

    def fn(x, y=None, k=3.0):
        return x * k if y is None else x + y

    assert [t.name for t in ir.create_graph(fn, spec).inputs] == ["x"]
    assert [t.name for t in ir.create_graph(fn, spec, spec).inputs] == ["x", "y"]
    signature = r"do not match .*fn\(x, y=None, k=3.0\)"
    with pytest.raises(ValueError, match=signature + ".*missing a required argument: 'x'"):
        ir.create_graph(fn)
    with pytest.raises(ValueError, match=signature + ".*too many positional"):
        ir.create_graph(fn, spec, spec, 1.0, 2.0)
    with pytest.raises(ValueError, match=signature + ".*unexpected keyword argument 'z'"):
        ir.create_graph(fn, spec, z=spec)


def test_mixed_containers_and_bad_callables_and_bad_returns_raise():
    ir = popxl.Ir()
    spec = popxl.TensorSpec((2,), popxl.float32)
    with pytest.raises(TypeError, match="'xs' mixes tensors and non-tensors"):
        ir.create_graph(lambda xs: xs[0], [spec, 1.0])
    with pytest.raises(TypeError, match="got int"):
        ir.create_graph(3, spec)
    with pytest.raises(ValueError, match="returned str"):
        ir.create_graph(lambda x: "oops", spec)
    with pytest.raises(ValueError, match="returned list"):
        ir.create_graph(lambda x: [x, 1.0], spec)


def test_return_value_none_tensor_or_iterable_sets_the_outputs_in_order():
    ir = popxl.Ir()
    spec = popxl.TensorSpec((2,), popxl.float32)
    assert ir.create_graph(lambda x: None, spec).outputs == ()
    g1 = ir.create_graph(lambda x: x + 1.0, spec)
    assert len(g1.outputs) == 1
    g2 = ir.create_graph(lambda x: (x * 2.0, x, x - 1.0), spec)
    with ir.main_graph:
        outs = ops.call(g2, popxl.constant(np.array([1.0, 2.0], np.float32)))
    got = run_main(ir, *outs)
    for g, w in zip(got, ([2.0, 4.0], [1.0, 2.0], [0.0, 1.0]), strict=True):
        np.testing.assert_array_equal(g, w)


def test_tensor_by_ref_annotations_mark_inputs_by_reference_and_updates_reach_the_caller():
    ir = popxl.Ir()
    spec = popxl.TensorSpec((), popxl.float32)

    def fn(a: popxl.TensorByRef, bs: typing.List[popxl.TensorByRef], c):  # noqa: UP006
        extra = popxl.graph_input((), popxl.float32, "extra", by_ref=True)
        for t in (a, *bs, c, extra):
            ops.accumulate_(t, popxl.constant(1.0))

    g = ir.create_graph(fn, spec, [spec], spec)
    assert [(t.name, g.is_input_by_ref(t)) for t in g.inputs] == [
        ("a", True), ("bs_0", True), ("c", False), ("extra", True),
    ]  # fmt: skip
    with ir.main_graph, popxl.in_sequence():
        vs = [popxl.variable(0.0, name=n) for n in "abce"]
        ops.call(g, *vs)
        outs = [v * 1.0 for v in vs]
    got = run_main(ir, *outs)
    # By-reference inputs are modified in the caller; c is passed by value.
    assert [float(x) for x in got] == [1.0, 1.0, 0.0, 1.0]


def test_varargs_annotated_by_ref_are_all_by_reference():
    ir = popxl.Ir()
    spec = popxl.TensorSpec((), popxl.float32)

    def fn(*xs: popxl.TensorByRef):
        return None

    g = ir.create_graph(fn, spec, spec)
    assert [g.is_input_by_ref(t) for t in g.inputs] == [True, True]


# ----------------------------------------------------------------------------------------
# Tensor attributes and dtypes (spec §3)
# ----------------------------------------------------------------------------------------

HOST_DTYPES = {
    "python_int": (1, {}, popxl.int32),
    "python_float": (1.0, {}, popxl.float32),
    "python_bool": (True, {}, popxl.bool),
    "float64_array_downcast": (np.zeros(2), {}, popxl.float32),
    "int64_array_downcast": (np.zeros(2, np.int64), {}, popxl.int32),
    "uint64_array_downcast": (np.zeros(2, np.uint64), {}, popxl.uint32),
    "int64_kept_without_downcast": (np.zeros(2, np.int64), {"downcast": False}, popxl.int64),
    "float16_array": (np.zeros(2, np.float16), {}, popxl.float16),
    "explicit_dtype": (np.zeros(2), {"dtype": popxl.float16}, popxl.float16),
    "explicit_dtype_name": ([1, 2], {"dtype": "int8"}, popxl.int8),
    "torch_tensor": (torch.zeros(2, dtype=torch.float16), {}, popxl.float16),
    "torch_requires_grad": (torch.zeros(2, requires_grad=True), {}, popxl.float32),
    "list_of_floats": ([1.5, 2.5], {}, popxl.float32),
}


@pytest.mark.parametrize("factory", ["variable", "constant"])
@pytest.mark.parametrize("case", HOST_DTYPES)
def test_host_data_dtype_rules_for_variables_and_constants(case, factory):
    data, kwargs, want = HOST_DTYPES[case]
    ir = popxl.Ir()
    with ir.main_graph:
        t = getattr(popxl, factory)(data, **kwargs)
        copied = t * 1 if want != popxl.bool else ops.logical_not(ops.logical_not(t))
    assert t.dtype == want and copied.dtype == want
    assert t.dtype.as_numpy() == np.dtype(want.as_numpy())
    assert t.dtype.as_torch() == want.as_torch()
    (got,) = run_main(ir, copied)
    assert got.dtype == want.as_numpy()
    expected = data.detach().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    np.testing.assert_array_equal(got, expected.astype(want.as_numpy()))


def test_tensor_shape_attributes():
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.zeros((2, 3, 4), np.float32), name="v")
        s = popxl.constant(5.0)
    assert (v.shape, v.rank, v.nelms, v.meta_shape) == ((2, 3, 4), 3, 24, ())
    assert (s.shape, s.rank, s.nelms) == ((), 0, 1)
    assert v.spec == popxl.TensorSpec((2, 3, 4), popxl.float32) and hash(v.spec) == hash(
        popxl.TensorSpec((2, 3, 4), "float32")
    )
    assert dict(v.spec) == {"shape": (2, 3, 4), "dtype": popxl.float32, "meta_shape": ()}
    assert v.strides() == (48, 16, 4) and v.strides((5, 2)) == (8, 4)
    assert (v.shape_on_host, v.shape_on_replica, v.retrieval_mode) == (
        (2, 3, 4),
        (2, 3, 4),
        "one_per_group",
    )
    assert v.replica_grouping.num_groups == 1
    assert v.ir is ir and v.tile_set == "compute"
    assert isinstance(v, popxl.Variable) and isinstance(s, popxl.Constant)
    np.testing.assert_array_equal(s.data, np.float32(5.0))
    assert repr(v) == "Variable[v float32 (2, 3, 4)]"


def test_op_outputs_keep_the_input_dtype_for_every_numeric_dtype():
    ir = popxl.Ir()
    names = ["float16", "float32", "int8", "int16", "int32", "uint8"]
    with ir.main_graph:
        outs = [popxl.constant(np.array([1, 2, 3]), getattr(popxl, n)) + 1 for n in names]
    assert [o.dtype.name for o in outs] == names
    got = run_main(ir, *outs)
    for g, n in zip(got, names, strict=True):
        assert g.dtype == getattr(popxl, n).as_numpy()
        np.testing.assert_array_equal(g, [2, 3, 4])


def test_graph_input_and_output_rules():
    ir = popxl.Ir()
    with ir.main_graph:
        outside = popxl.constant(1.0, name="outside")
    g = ir.create_empty_graph("io")
    with g:
        x = popxl.graph_input((2,), popxl.float16, "x", meta_shape=(4,))
        assert (x.id, x.dtype, x.meta_shape) == ("io_subgraph(0)/x", popxl.float16, (4,))
        popxl.graph_output(x)
        with pytest.raises(ValueError, match="'outside'.*main_graph"):
            popxl.graph_output(outside)
        with pytest.raises(TypeError, match="got float"):
            popxl.graph_output(1.0)
        with pytest.raises(ValueError, match="main graph"):
            popxl.variable(1.0)
    assert g.outputs == (x,) and x in g and outside not in g
    with pytest.raises(TypeError):
        _ = 1.0 in g


# ----------------------------------------------------------------------------------------
# The Ir (spec §1)
# ----------------------------------------------------------------------------------------


def test_ir_identity_settings_and_context_helpers():
    ir, other = popxl.Ir(), popxl.Ir(replication=4)
    assert repr(ir) == f"Ir[id={ir.id}]" and ir == ir and not (ir == other)
    with pytest.raises(TypeError, match="Ir with NoneType"):
        _ = ir == None  # noqa: E711
    assert (ir.replication_factor, ir.instance_replication_factor, ir.num_host_transfers) == (
        1,
        1,
        1,
    )
    assert (other.replication_factor, other.instance_replication_factor) == (4, 4)
    ir.replication_factor = 2
    ir.num_host_transfers = 3
    assert (ir.replication_factor, ir.num_host_transfers) == (2, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            ir.num_host_transfers = bad
        with pytest.raises(ValueError):
            ir.replication_factor = bad
    with pytest.raises(TypeError):
        popxl.Ir(replication_factor=2)
    with ir.main_graph:
        assert popxl.gcg() is ir.main_graph and popxl.gmg() is ir.main_graph and popxl.gir() is ir
        g = ir.create_empty_graph()
        with g:
            assert popxl.gcg() is g and popxl.gmg() is ir.main_graph
    for fn in (popxl.gcg, popxl.gmg, popxl.gir):
        with pytest.raises(RuntimeError):
            fn()


def test_in_sequence_validates_its_mode():
    with pytest.raises(TypeError):
        with popxl.in_sequence(None):
            pass
    with pytest.raises(ValueError):
        with popxl.in_sequence("sometimes"):
            pass
    for mode in (True, False, "pass"):
        with popxl.in_sequence(mode):
            pass


def test_popxl_module_paths_import_like_upstream():
    """Programs import submodules directly (issue 2, item 5)."""
    import importlib

    import torch_popxl

    for name in ("ops", "ops.collectives", "ops.var_updates", "ops.call", "dtypes", "transforms",
                 "transforms.autodiff", "tensor", "remote_buffer", "streams", "replica_grouping",
                 "context", "errors"):  # fmt: skip
        importlib.import_module(f"torch_popxl.{name}")
    from torch_popxl.ops.call import CallSiteInfo
    from torch_popxl.transforms.autodiff import GradGraphInfo

    assert CallSiteInfo and GradGraphInfo
    assert torch_popxl.ops.collectives.replicated_all_reduce and torch_popxl.transforms.autodiff
    assert torch_popxl.dtypes.float32 is torch_popxl.float32


def test_tensor_keys_upstream_refuses_raise_type_error():
    # bool is an int to Python and floats index nothing: upstream raises TypeError for both.
    with popxl.Ir().main_graph:
        x = popxl.variable(np.arange(6).reshape(2, 3))
        for key in (True, 1.5, "a", (0, False), (slice(None), 0.0)):
            with pytest.raises(TypeError, match="is not supported: index with ints"):
                _ = x[key]
        assert x[1, np.int64(2)].shape == () and x[None, ..., 1:].shape == (1, 2, 2)


def test_streams_and_main_graph_tensors_share_one_namespace():
    # Upstream's host streams are main-graph tensors: a stream named like an existing tensor
    # gets the clash suffix, and so does a tensor named like a stream; host_load names its
    # result "<name>_hostload" (name defaulting to the stream's id).
    ir = popxl.Ir()
    with ir.main_graph:
        v = popxl.variable(np.zeros(2, np.float32), name="h2d_stream")
        h2d = popxl.h2d_stream((2,), popxl.float32)
        x = ops.host_load(h2d)
        s = popxl.d2h_stream((2,), popxl.float32, name="w")
        w = popxl.variable(np.ones(2, np.float32), name="w")
        ops.host_store(s, x + w + v)
        named = ops.host_load(h2d, "x")
    assert (v.id, h2d.tensor_id, x.id) == (
        "h2d_stream",
        "h2d_stream__t1",
        "h2d_stream__t1_hostload",
    )
    assert (s.tensor_id, w.id, named.id) == ("w", "w__t1", "x_hostload")
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({h2d: np.array([1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(out[s], [2.0, 3.0])
    with popxl.Session(ir, "ipu_model") as session:
        out = session.run({h2d: np.array([1.0, 2.0], np.float32)})
    np.testing.assert_array_equal(out[s], [2.0, 3.0])
