"""Capture: torch functions, ``torch.nn`` modules and ``torch.Tensor`` methods applied to popxl
tensors inside a graph are recorded at aten level and run like the eager code (issue 2 item 3).

Values are compared with eager torch on the same inputs (float32, rtol 1e-5 / atol 1e-6), with
both executors. The bad-input half checks the errors the issue asks for: data-dependent control
flow, tensors of another graph or Ir, ops outside a graph, and PopXL's Tensor protocol quirks
(spec §0 "Equality quirks", §3.2).
"""

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.ops as ops
from torch_popxl.errors import DataDependentError, PopXLError

EXECUTORS = ("reference", "fast")
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(params=EXECUTORS)
def executor(request):
    return request.param


def capture_and_run(fn, x: np.ndarray, executor: str):
    """``fn`` on a host-loaded ``x`` in a fresh Ir; returns (host output, ir, session)."""
    ir = popxl.Ir()
    with ir.main_graph:
        xs = popxl.h2d_stream(x.shape, popxl.float32, "x")
        y = fn(ops.host_load(xs))
        ys = popxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(ys, y)
    session = popxl.Session(ir, executor=executor)
    with session:
        out = session.run({xs: x})[ys]
    return out, ir, session


def close(got, want):
    want = want.detach().numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


X = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32)


# ----------------------------------------------------------------------------------------
# Torch code on popxl tensors
# ----------------------------------------------------------------------------------------

TORCH_FUNCTIONS = {
    "gelu_exact": lambda x: torch.nn.functional.gelu(x),
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "softplus_then_mean": lambda x: torch.nn.functional.softplus(x).mean(dim=-1),
    "relu_max_dim_values": lambda x: torch.max(torch.relu(x), dim=1).values,
    "einsum": lambda x: torch.einsum("bij,bkj->bik", x, x),
    "cumsum": lambda x: torch.cumsum(x, dim=2),
    "flatten_1": lambda x: x.flatten(1),
    "view": lambda x: x.view(4, -1),
    "view_with_size_0": lambda x: x.view(x.size(0), -1),
    "tensor_methods_chain": lambda x: x.exp().sum(dim=2, keepdim=True).log().squeeze(-1),
    "torch_where_on_comparison": lambda x: torch.where(x > 0, x, x * 0.1),
    "tensor_comparison_operator": lambda x: (x >= 0.5) | (x < -0.5),
    "mixed_with_a_torch_constant": lambda x: x * torch.arange(3, dtype=torch.float32),
}


@pytest.mark.parametrize("case", TORCH_FUNCTIONS)
def test_torch_function_on_popxl_tensors_matches_eager(case, executor):
    fn = TORCH_FUNCTIONS[case]
    got, _, _ = capture_and_run(fn, X, executor)
    want = fn(torch.from_numpy(X))
    if want.dtype == torch.bool:
        np.testing.assert_array_equal(got, want.numpy())
    else:
        close(got, want)


def test_size_and_dim_return_python_ints_from_the_static_shape():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.constant(X)
        assert x.size(0) == 4 and isinstance(x.size(0), int)
        assert tuple(x.size()) == X.shape == x.shape
        assert x.dim() == 3 == x.rank


def test_nn_linear_parameters_become_variables_holding_the_module_weights(executor):
    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 5)
    got, ir, session = capture_and_run(lambda x: linear(x), X, executor)
    close(got, linear(torch.from_numpy(X)))
    variables = ir.main_graph.variables
    assert sorted(v.shape for v in variables) == [(5,), (5, 3)]
    data = session.get_tensors_data(variables)
    by_shape = {v.shape: data[v] for v in variables}
    np.testing.assert_array_equal(by_shape[(5, 3)], linear.weight.detach().numpy())
    np.testing.assert_array_equal(by_shape[(5,)], linear.bias.detach().numpy())


def test_a_module_called_twice_shares_one_set_of_variables(executor):
    torch.manual_seed(1)
    linear = torch.nn.Linear(3, 3)
    got, ir, _ = capture_and_run(lambda x: linear(torch.tanh(linear(x))), X, executor)
    close(got, linear(torch.tanh(linear(torch.from_numpy(X)))))
    assert len(ir.main_graph.variables) == 2


def test_nn_layer_norm_and_mlp_match_eager(executor):
    torch.manual_seed(2)
    mlp = torch.nn.Sequential(
        torch.nn.Flatten(1),
        torch.nn.Linear(6, 8),
        torch.nn.GELU(),
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 2),
        torch.nn.LogSoftmax(dim=-1),
    )
    got, ir, _ = capture_and_run(mlp, X, executor)
    close(got, mlp(torch.from_numpy(X)))
    assert len(ir.main_graph.variables) == 6  # 2 Linear x (weight, bias) + LayerNorm (weight, bias)


def test_variables_made_from_parameters_are_updated_by_var_updates(executor):
    # Captured parameters are ordinary variables: an in-place update changes the weight.
    linear = torch.nn.Linear(3, 2, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.ones(2, 3))
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        y = linear(popxl.constant(np.ones((1, 3), np.float32)))
        (w,) = ir.main_graph.variables
        ops.accumulate_(w, popxl.constant(np.full((2, 3), 0.5, np.float32)))
        ys = popxl.d2h_stream(y.shape, y.dtype, "y")
        ops.host_store(ys, y)
    with popxl.Session(ir, executor=executor) as session:
        np.testing.assert_array_equal(session.run()[ys], [[3.0, 3.0]])
        np.testing.assert_array_equal(session.get_tensor_data(w), np.full((2, 3), 1.5, np.float32))
    # The module itself is untouched: the variable holds a copy.
    np.testing.assert_array_equal(linear.weight.detach().numpy(), np.ones((2, 3), np.float32))


def test_parameter_inside_a_subgraph_raises_value_error():
    linear = torch.nn.Linear(3, 3)
    ir = popxl.Ir()
    with ir.main_graph:
        with pytest.raises(ValueError, match="Parameter of shape \\(3, 3\\).*subgraph"):
            ir.create_graph(lambda x: linear(x), popxl.TensorSpec((2, 3), popxl.float32))


# ----------------------------------------------------------------------------------------
# Deterministic text form
# ----------------------------------------------------------------------------------------


def _build_for_text():
    torch.manual_seed(3)
    block = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.GELU())
    ir = popxl.Ir()
    with ir.main_graph:
        xs = popxl.h2d_stream((4, 2, 3), popxl.float32, "x")
        x = ops.host_load(xs)
        with popxl.name_scope("block"):
            y = block(x).flatten(1)
        g = ir.create_graph(lambda t: ops.softmax(t * 2.0, -1), y)
        (z,) = ops.call(g, y)
        ops.host_store(popxl.d2h_stream(z.shape, z.dtype, "z"), z)
    return ir, g


def test_text_form_is_identical_for_two_identical_builds():
    (ir1, g1), (ir2, g2) = _build_for_text(), _build_for_text()
    assert ir1.main_graph.text() == ir2.main_graph.text()
    assert g1.text() == g2.text()
    assert str(g1) == g1.text()


def test_text_form_lists_inputs_variables_ops_and_outputs():
    ir, g = _build_for_text()
    main = ir.main_graph.text().splitlines()
    assert main[0] == "graph main_graph:"
    assert "  variable block/param: float32[4, 3]" in main
    assert "  x_hostload: float32[4, 2, 3] = HostLoad() <- x" in main  # upstream's name
    assert any(
        line.startswith("  block/gelu: float32[4, 2, 4] = aten.gelu.default(") for line in main
    )
    sub = g.text().splitlines()
    gid = "_build_for_text.<lambda>_subgraph(0)"
    assert sub[0] == f"graph {gid}:"
    assert sub[1] == f"  input {gid}/t: float32[4, 8]"
    assert sub[-1] == f"  output {gid}/_softmax"


def test_text_form_differs_when_the_program_differs():
    ir1, _ = _build_for_text()
    ir2 = popxl.Ir()
    with ir2.main_graph:
        xs = popxl.h2d_stream((4, 2, 3), popxl.float32, "x")
        ops.host_store(popxl.d2h_stream((4, 2, 3), popxl.float32, "z"), ops.host_load(xs) + 1.0)
    assert ir1.main_graph.text() != ir2.main_graph.text()


# ----------------------------------------------------------------------------------------
# Data-dependent control flow
# ----------------------------------------------------------------------------------------


def _data_dependent_if(t):
    if t.sum() > 0:
        return t
    return -t


class _BranchyModule(torch.nn.Module):
    def forward(self, x):
        return x if x.mean() > 0 else -x


DATA_DEPENDENT = {
    "item": (lambda t: t.sum().item(), r"\.item\(\)"),
    "if_sum_greater_than_zero": (_data_dependent_if, r"if t\.sum\(\) > 0"),
    "bool": (lambda t: bool(t * 2), "bool()"),
    "float": (lambda t: float(t.sum()), r"float\(\)"),
    "int": (lambda t: int(t.sum()), r"int\(\)"),
    "module_forward_branch": (lambda t: _BranchyModule()(t), "not known"),
    "tolist": (lambda t: t.tolist(), r"\.tolist\(\)"),
    "numpy": (lambda t: t.numpy(), r"\.numpy\(\)"),
    # ops whose result's shape depends on values
    "nonzero": (lambda t: torch.nonzero(t > 0), "static shapes"),
    "masked_select": (lambda t: torch.masked_select(t, t > 0), "static shapes"),
}


@pytest.mark.parametrize("case", DATA_DEPENDENT)
def test_data_dependent_python_raises_data_dependent_error(case):
    fn, match = DATA_DEPENDENT[case]
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(X, name="t")
        with pytest.raises(DataDependentError, match=match) as info:
            fn(t)
    message = str(info.value)
    assert "where" in message  # says how to fix it
    assert isinstance(info.value, PopXLError)


def test_graph_is_still_usable_after_a_data_dependent_error(executor):
    def fn(x):
        with pytest.raises(DataDependentError):
            x.max().item()
        return torch.where(x.max() > 0, x, -x)

    got, _, _ = capture_and_run(fn, X, executor)
    np.testing.assert_allclose(got, X if X.max() > 0 else -X)


# ----------------------------------------------------------------------------------------
# Tensors of another graph or Ir; ops outside a graph
# ----------------------------------------------------------------------------------------

CROSS_USES = {
    "operator": lambda t: t + 1.0,
    "popxl_op": lambda t: ops.mul(t, 2.0),
    "torch_function": lambda t: torch.relu(t),
    "module": lambda t: torch.nn.Linear(3, 3)(t),
    "host_store": lambda t: ops.host_store(popxl.d2h_stream(t.shape, t.dtype), t),
    "var_update": lambda t: ops.accumulate_(t, t),
}


@pytest.mark.parametrize("case", CROSS_USES)
def test_tensor_of_another_ir_raises_value_error_naming_it(case):
    ir_a, ir_b = popxl.Ir(), popxl.Ir()
    with ir_a.main_graph:
        foreign = popxl.variable(np.ones((2, 3), np.float32), name="foreign")
    with ir_b.main_graph:
        with pytest.raises(ValueError, match="'foreign'"):
            CROSS_USES[case](foreign)


@pytest.mark.parametrize("case", ["operator", "popxl_op", "torch_function", "var_update"])
def test_tensor_of_the_parent_graph_in_a_subgraph_raises_value_error_naming_it(case):
    ir = popxl.Ir()
    with ir.main_graph:
        parent = popxl.variable(np.ones((2, 3), np.float32), name="parent_w")
        with pytest.raises(ValueError, match="'parent_w'.*main_graph"):
            ir.create_graph(
                lambda x: CROSS_USES[case](parent) + x, popxl.TensorSpec((2, 3), popxl.float32)
            )


def test_mixing_two_foreign_tensors_in_one_op_names_the_foreign_one():
    ir_a, ir_b = popxl.Ir(), popxl.Ir()
    with ir_a.main_graph:
        a = popxl.constant(1.0, name="from_a")
    with ir_b.main_graph:
        b = popxl.constant(2.0, name="from_b")
        with pytest.raises(ValueError, match="'from_a'.*another Ir"):
            ops.add(b, a)


OUTSIDE = {
    "popxl_op": lambda t: ops.add(t, t),
    "operator": lambda t: t * 2,
    "torch_function": lambda t: torch.nn.functional.gelu(t),
    "tensor_method": lambda t: t.flatten(1),
    "constant": lambda t: popxl.constant(1.0),
    "variable": lambda t: popxl.variable(1.0),
    "h2d_stream": lambda t: popxl.h2d_stream((1,), popxl.float32),
    "gcg": lambda t: popxl.gcg(),
    "gmg": lambda t: popxl.gmg(),
}


@pytest.mark.parametrize("case", OUTSIDE)
def test_op_outside_a_graph_context_raises_runtime_error(case):
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(X)
    with pytest.raises(RuntimeError, match="No graph context"):
        OUTSIDE[case](t)


def test_nesting_graphs_of_two_irs_raises_runtime_error():
    ir_a, ir_b = popxl.Ir(), popxl.Ir()
    with ir_a.main_graph:
        with pytest.raises(RuntimeError, match="two different Irs"):
            with ir_b.main_graph:
                pass
        # The failed enter left the stack as it was.
        assert popxl.gcg() is ir_a.main_graph


# ----------------------------------------------------------------------------------------
# Tensor protocol: == identity, no iteration, len
# ----------------------------------------------------------------------------------------


def test_tensor_equality_is_identity_and_returns_a_python_bool():
    ir = popxl.Ir()
    with ir.main_graph:
        a = popxl.constant(X, name="same")
        b = popxl.constant(X, name="same")  # same values, different tensor ("same__t1")
        assert (a == a) is True
        assert (a == b) is False
        assert (a != b) is True
        assert (a == 1.0) is False
        assert ir.main_graph.get_tensor("same") == a
        assert {a: 1, b: 2}[a] == 1  # hashable
    other = popxl.Ir()
    with other.main_graph:
        c = popxl.constant(X, name="same")
    assert (a == c) is False  # same id, other Ir


def test_tensor_iteration_and_membership_raise_type_error():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(X)
        with pytest.raises(TypeError):
            iter(t)
        with pytest.raises(TypeError):
            for _ in t:
                pass
        with pytest.raises(TypeError):
            _ = 1.0 in t


def test_len_is_the_first_dimension_and_scalars_have_none():
    ir = popxl.Ir()
    with ir.main_graph:
        assert len(popxl.constant(X)) == 4
        with pytest.raises(ValueError, match="'scalar'"):
            len(popxl.constant(1.0, name="scalar"))


def test_tensor_cannot_be_constructed_directly():
    with pytest.raises(RuntimeError, match="popxl.variable"):
        popxl.Tensor()


def test_unknown_attribute_is_an_attribute_error():
    ir = popxl.Ir()
    with ir.main_graph:
        t = popxl.constant(X)
    with pytest.raises(AttributeError, match="no_such_method"):
        t.no_such_method()
