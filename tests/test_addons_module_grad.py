"""addons.Module's custom gradients (``build_grad`` with ``aux`` / ``var_grad``), ``call_module``,
graph caching and upstream's guard rails, checked against torch / hand-computed gradients."""

from __future__ import annotations

import re
import warnings
from functools import partial

import numpy as np
import pytest
import torch

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl import ops


def _run(ir, tensors, executor="fast"):
    """Stream ``tensors`` out of one run; returns their values in order."""
    with ir.main_graph:
        streams = []
        for t in tensors:
            s = popxl.d2h_stream(t.shape, t.dtype)
            ops.host_store(s, t)
            streams.append(s)
    with popxl.Session(ir, "ipu_model", executor=executor) as session:
        out = session.run()
    return [out[s] for s in streams]


class LinearBG(addons.Module):
    """Upstream's documented example: a linear layer with a hand-written gradient."""

    def __init__(self, features: int):
        super().__init__()
        self.features = features

    def build(self, x):
        w = self.add_variable_input(
            "w", partial(np.random.normal, 0, 1, (x.shape[-1], self.features)), popxl.float32
        )
        b = self.add_variable_input(
            "b", partial(np.random.normal, 0, 1, (self.features,)), popxl.float32
        )
        self.aux["x"] = x
        self.aux["w"] = w
        return x @ w + b

    def build_grad(self, dy):
        self.var_grad["b"] = ops.sum(dy, 0)
        self.var_grad["w"] = (dy.T @ self.aux["x"]).T
        return dy @ self.aux["w"].T


class Scale3(addons.Module):
    """``y = x * s``; its build_grad deliberately claims ``dx = 3 * s * dy`` (not the true
    gradient), so tests can tell it was used."""

    def build(self, x):
        s = self.add_variable_input("s", lambda: np.float32(2.0), popxl.float32)
        self.aux["s"] = s
        self.aux["x"] = x
        return x * s

    def build_grad(self, dy):
        self.var_grad["s"] = ops.sum(dy * self.aux["x"])
        return dy * self.aux["s"] * 3.0


class Net(addons.Module):
    def __init__(self, child_autodiff: str = "auto"):
        super().__init__()
        self.child_autodiff = child_autodiff

    def build(self, x):
        w = self.add_variable_input("w", lambda: np.full((3,), 0.5, np.float32), popxl.float32)
        (h,) = self.call_module(Scale3(), name="scale", autodiff=self.child_autodiff)(x * w)
        return ops.relu(h) + w


def test_build_grad_linear_matches_torch_forward_and_gradients():
    np.random.seed(0)
    xd = np.random.normal(size=(4, 3)).astype(np.float32)
    dyd = np.random.normal(size=(4, 2)).astype(np.float32)
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(xd, name="x")
        facts, fwd = LinearBG(2).create_graph(x)
        bwd = fwd.autodiff()
        info = bwd.grad_graph_info
        assert [e.connection_type.name for e in info.expected_inputs] == ["FwdGrad", "Fwd", "Fwd"]
        assert [e.fwd_tensor for e in info.expected_outputs] == [
            fwd.graph.inputs[0],
            fwd.args.w,
            fwd.args.b,
        ]
        weights = facts.init()
        call = fwd.bind(weights).call_with_info(x)
        grads = bwd.call(popxl.constant(dyd), args=info.inputs_dict(call))
    y, dx, dw, db = _run(ir, [call.outputs[0], *grads])
    with popxl.Session(ir, "ipu_model") as s:
        w0, b0 = s.get_tensor_data(weights.w), s.get_tensor_data(weights.b)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (xd, w0, b0))
    ty = tx @ tw + tb
    ty.backward(torch.tensor(dyd))
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=1e-5)
    for got, want in ((dx, tx.grad), (dw, tw.grad), (db, tb.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("executor", ["fast", "reference"])
def test_call_module_child_build_grad_is_used_when_the_parent_is_differentiated(executor):
    # x = [1, -2, 3], w = 0.5, s = 2: h = x*w*s = [1, -2, 3], out = relu(h) + w.
    # d out = 1: dh = [1, 0, 1]; the child's gradient: d(xw) = 3*s*dh = [6, 0, 6],
    # ds = sum(dh * x*w) = 2; dx = d(xw) * w = [3, 0, 3]; dw = d(xw) * x + 1 = [7, 1, 19].
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.array([1.0, -2.0, 3.0], np.float32), name="x")
        facts, fwd = Net().create_graph(x)
        assert fwd.args.keys_flat() == ["w", "scale.s"] and len(fwd.called_graphs_grad_info) == 1
        bwd = addons.autodiff(fwd)
        weights = facts.init()
        call = fwd.bind(weights).call_with_info(x)
        grads = bwd.call(
            popxl.constant(np.ones(3, np.float32)), args=bwd.grad_graph_info.inputs_dict(call)
        )
    out, dx, dw, ds = _run(ir, [call.outputs[0], *grads], executor)
    np.testing.assert_array_equal(out, [1.5, 0.5, 3.5])
    np.testing.assert_array_equal(dx, [3.0, 0.0, 3.0])
    np.testing.assert_array_equal(dw, [7.0, 1.0, 19.0])
    assert ds == 2.0


def test_call_module_with_autodiff_none_leaves_the_child_unsafe_to_autodiff_through():
    # As upstream: the graph of a module that implements build_grad may only be differentiated
    # by its build_grad, so without its grad graph the parent's autodiff refuses (and changes
    # nothing), instead of silently replacing the hand-written gradient.
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.array([1.0, -2.0, 3.0], np.float32), name="x")
        net = Net(child_autodiff="none")
        facts, fwd = net.create_graph(x)
        assert not fwd.called_graphs_grad_info
        n_outputs = len(fwd.graph.outputs)
        with pytest.raises(ValueError, match="marked as unsafe to autodiff.*Scale3"):
            addons.autodiff(fwd)
        with pytest.raises(ValueError, match="marked as unsafe to autodiff"):
            addons.autodiff_with_accumulation(fwd, fwd.args.tensors)
        assert len(fwd.graph.outputs) == n_outputs  # the failed calls changed nothing


class LossHead(addons.Module):
    """The GPT-3 / GPT-J applications' pattern: the loss module returns the gradient it already
    computed (``cross_entropy_with_grad``) from ``build_grad``."""

    def build(self, logits, labels):
        loss, dx = addons.cross_entropy_with_grad(logits, labels)
        self.aux["dx"] = dx
        return loss

    def build_grad(self, dloss):
        return self.aux["dx"]


def test_loss_head_build_grad_matches_torch_cross_entropy_gradient():
    np.random.seed(1)
    logits_d = np.random.normal(size=(6, 5)).astype(np.float32)
    labels_d = np.array([0, 4, 2, 1, 3, 3], np.int32)
    ir = popxl.Ir()
    with ir.main_graph:
        logits = popxl.variable(logits_d, name="logits")
        labels = popxl.variable(labels_d, name="labels")
        _, fwd = LossHead().create_graph(logits, labels)
        # As upstream, every required input needs a returned gradient: require the logits only.
        bwd = fwd.autodiff(grads_required=[fwd.graph.inputs[0]])
        call = fwd.call_with_info(logits, labels)
        (dlogits,) = bwd.call(
            popxl.constant(np.float32(1.0)), args=bwd.grad_graph_info.inputs_dict(call)
        )
        with pytest.raises(ValueError, match="returned 1 gradients, but 2 are required"):
            LossHead().create_graph(logits, labels)[1].autodiff()
    loss, got = _run(ir, [call.outputs[0], dlogits])
    tl_in = torch.tensor(logits_d, requires_grad=True)
    tl = torch.nn.functional.cross_entropy(tl_in, torch.tensor(labels_d, dtype=torch.long))
    tl.backward()
    np.testing.assert_allclose(loss, tl.item(), rtol=1e-5)
    np.testing.assert_allclose(got, tl_in.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_grads_required_subset_outputs_only_those_variable_gradients():
    # A var_grad entry that is not required is left out (build_grad still returns dx).
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones((2, 3), np.float32))
        facts, fwd = LinearBG(2).create_graph(x)
        xin = fwd.graph.inputs[0]
        bwd = fwd.autodiff(grads_required=[xin, fwd.args.w])
        assert [e.fwd_tensor for e in bwd.grad_graph_info.expected_outputs] == [xin, fwd.args.w]
        assert len(bwd.graph.outputs) == 2


# ---- graph caching and outlining -----------------------------------------------------------


class Plain(addons.Module):
    def build(self, x):
        w = self.add_variable_input("w", lambda: np.ones(x.shape[-1:], np.float32), x.dtype)
        return x * w


def test_cached_module_reuses_the_graph_for_an_equal_input_signature():
    ir = popxl.Ir()
    with ir.main_graph:
        m = Plain(cache=True)
        a = popxl.variable(np.ones((2, 3), np.float32))
        b = popxl.variable(np.zeros((2, 3), np.float32))  # other values, same spec
        c = popxl.variable(np.ones((2, 4), np.float32))
        f1, g1 = m.create_graph(a)
        f2, g2 = m.create_graph(b.spec)
        _, g3 = m.create_graph(c)
        assert g1.graph is g2.graph and g3.graph is not g1.graph
        assert f1.keys_flat() == f2.keys_flat() == ["w"]
        # The same graph, called with different weights, computes each caller's product.
        w1, w2 = f1.init(), f2.init()
        (y1,) = g1.bind(w1).call(a)
        (y2,) = g2.bind(w2).call(b)
        # Without caching each create_graph builds a new graph.
        assert Plain().create_graph(a)[1].graph is not Plain().create_graph(a)[1].graph
    v1, v2 = _run(ir, [y1, y2])
    np.testing.assert_array_equal(v1, np.ones((2, 3)))
    np.testing.assert_array_equal(v2, np.zeros((2, 3)))


def test_cache_with_build_grad_is_rejected():
    with pytest.raises(ValueError, match="cannot be used with a module that implements build_grad"):
        Scale3(cache=True)
    with pytest.raises(ValueError, match="grad_inlining_error should be one of"):
        Scale3(grad_inlining_error="loud")


# ---- guard rails ---------------------------------------------------------------------------


class Inliner(addons.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.child = Scale3(grad_inlining_error=mode)

    def build(self, x):
        return self.child(x)


def test_inlining_a_module_with_build_grad_errors_warns_or_passes():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32))
        with pytest.raises(RuntimeError, match="call_module"):
            Inliner("error").create_graph(x)
        with pytest.warns(UserWarning, match="call_module"):
            Inliner("warning").create_graph(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            facts, graph = Inliner("none").create_graph(x)
        assert facts.keys_flat() == ["child.s"]


class NoVarGrad(addons.Module):
    def build(self, x):
        self.add_variable_input("s", lambda: np.float32(2.0), popxl.float32)
        return x * 2.0

    def build_grad(self, dy):
        return dy * 2.0


class WrongShape(Scale3):
    def build_grad(self, dy):
        self.var_grad["s"] = ops.sum(dy * self.aux["x"])
        return ops.sum(dy)


class TwoOutputs(Scale3):
    def build_grad(self, dy):
        self.var_grad["s"] = ops.sum(dy * self.aux["x"])
        return dy, dy


class BadVarGrad(Scale3):
    def build_grad(self, dy):
        self.var_grad["s"] = dy  # shape (3,) for a scalar variable
        return dy


class UnknownVarGrad(Scale3):
    def build_grad(self, dy):
        self.var_grad["t"] = ops.sum(dy)
        return dy


class StarGrad(Scale3):
    def build_grad(self, *grads):
        return grads[0]


class NoGrads(Scale3):
    def build_grad(self, dy):
        self.var_grad["s"] = ops.sum(dy * self.aux["x"])


class NotATensor(Scale3):
    def build_grad(self, dy):
        self.var_grad["s"] = 0.0
        return dy


# popxl-addons' guard rails (module.py): programs and upstream's own tests match upstream's
# phrases, so each message leads with upstream's sentence, then says ours (None: only upstream's).
@pytest.mark.parametrize("module,error,upstream,match", [
    (NoVarGrad, ValueError, "Not all variable gradients have been specified in self.var_grad",
     r"did not set the gradients of the variables \['s'\]"),
    (WrongShape, ValueError, "Shape or meta-shape of output Tensor at position 0",
     r"output 0 has shape \(\)"),
    (TwoOutputs, ValueError, "Too many outputs in the grad graph",
     "returned 2 gradients, but 1 are required"),
    (NoGrads, ValueError, "Not all forward graph inputs have been specified as outputs", None),
    (BadVarGrad, ValueError, "Shape or meta-shape of Tensor does not match variable",
     r"var_grad\['s'\]: shape \(3,\)"),
    (UnknownVarGrad, KeyError, "Not a variable", "'t' is not a variable of the forward graph"),
    (NotATensor, TypeError, "Not a tensor", None),
    (StarGrad, TypeError, "signature must only have a fixed number of positional parameters",
     "fixed number of positional parameters"),
])  # fmt: skip
def test_create_grad_graph_errors_name_the_mistake(module, error, upstream, match):
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32))
        m = module()
        _, fwd = m.create_graph(x)
        n_outputs = len(fwd.graph.outputs)
        with pytest.raises(error, match=upstream) as err:
            m.create_grad_graph(fwd)
        if match is not None:
            assert re.search(match, str(err.value)), str(err.value)
        # State survives the error: nothing was stitched and the module is reset.
        assert len(fwd.graph.outputs) == n_outputs and len(m.aux) == 0


def test_graph_argument_errors_carry_upstreams_wording():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32))
        with pytest.raises(
            ValueError, match="You cannot use graph caching if you have implemented"
        ):
            Scale3(cache=True)
        m = Scale3()
        _, fwd = m.create_graph(x)
        with pytest.raises(
            ValueError, match="A Tensor specified in `grads_provided` is not a output"
        ):
            m.create_grad_graph(fwd, grads_provided=[x])
        with pytest.raises(
            ValueError, match="A Tensor specified in `grads_required` is not a input"
        ):
            m.create_grad_graph(fwd, grads_required=[fwd.graph.outputs[0]])
        # No gradient provided for build_grad's one parameter: popxl's create_graph refuses.
        with pytest.raises(ValueError, match="do not match the signature"):
            m.create_grad_graph(fwd, grads_provided=[])
        with pytest.raises(RuntimeError, match="get items within the `build_graph` method"):
            fwd.aux["x"]
        with pytest.raises(RuntimeError, match="use `var_grad` within the `build_graph` method"):
            m.var_grad["s"] = x
        fwd.autodiff()
        with pytest.raises(ValueError, match="Autodiff has already been applied"):
            fwd.autodiff()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"grads_provided": "input"}, r"grads_provided entry .* is not an output"),
        ({"grads_required": "output"}, r"grads_required entry .* is not an input"),
        ({"grads_provided": "str"}, r"grads_provided entries must be Tensors .*got str 'y'"),
        ({"grads_required": "twice"}, r"grads_required lists .* more than once"),
    ],
    ids=["provided-not-output", "required-not-input", "not-a-tensor", "duplicate"],
)
def test_create_grad_graph_argument_errors_are_value_errors_as_upstream(kwargs, match):
    # popxl-addons module.py _create_grad_graph_pre_validation raises ValueError for a
    # grads_provided entry that is not a forward output (or not a Tensor), a grads_required
    # entry that is not a forward input, and for duplicates.
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32))
        m = Scale3()
        _, fwd = m.create_graph(x)
        pick = {
            "input": [fwd.graph.inputs[0]],
            "output": [fwd.graph.outputs[0]],
            "str": ["y"],
            "twice": [fwd.graph.inputs[0], fwd.graph.inputs[0]],
        }
        args = {k: pick[v] for k, v in kwargs.items()}
        with pytest.raises(ValueError, match=match):
            m.create_grad_graph(fwd, **args)


def test_aux_and_var_grad_outside_build_grad_and_misuse_of_autodiff():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32))
        m = Scale3()
        _, fwd = m.create_graph(x)
        with pytest.raises(RuntimeError, match="only be read inside build_grad"):
            fwd.aux["s"]
        with pytest.raises(RuntimeError, match="only be used inside build_grad"):
            m.var_grad["s"] = x
        with pytest.raises(ValueError, match="grads_provided entry .* is not an output"):
            m.create_grad_graph(fwd, grads_provided=[x])
        fwd.autodiff()
        with pytest.raises(ValueError, match="already been differentiated"):
            fwd.autodiff()
        _, plain = Plain().create_graph(x)
        with pytest.raises(
            ValueError, match="method='build_grad' needs a graph created by a module"
        ):
            plain.autodiff(method="build_grad")
        with pytest.raises(NotImplementedError, match="needs build_grad to be overridden"):
            Plain().create_grad_graph(plain)
        with pytest.raises(ValueError, match="autodiff must be"):
            m.call_module(Plain(), autodiff="sometimes")


class Outer(addons.Module):
    """Calls Net (whose graph calls Scale3 with a given gradient) inline through a plain call."""

    def build(self, x):
        (y,) = self.call_module(Net(), autodiff="none")(x)
        return y


def test_a_given_gradient_two_calls_deep_is_used():
    # Outer calls Net (differentiated automatically), which calls Scale3 (its build_grad):
    # the numbers of test_call_module_child_build_grad_is_used_when_the_parent_is_differentiated.
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.array([1.0, -2.0, 3.0], np.float32), name="x")
        facts, fwd = Outer().create_graph(x)
        assert (
            fwd.args.keys_flat() == ["Net.w", "Net.scale.s"]
            and len(fwd.called_graphs_grad_info) == 1
        )
        bwd = addons.autodiff(fwd)
        call = fwd.bind(facts.init()).call_with_info(x)
        grads = bwd.call(
            popxl.constant(np.ones(3, np.float32)), args=bwd.grad_graph_info.inputs_dict(call)
        )
    out, dx, dw, ds = _run(ir, [call.outputs[0], *grads])
    np.testing.assert_array_equal(out, [1.5, 0.5, 3.5])
    np.testing.assert_array_equal(dx, [3.0, 0.0, 3.0])
    np.testing.assert_array_equal(dw, [7.0, 1.0, 19.0])
    assert ds == 2.0


class StraightThrough(addons.Module):
    def build(self, x):
        return ops.cast(ops.cast(x + 0.5, popxl.int32), popxl.float32)

    def build_grad(self, dy):
        return dy


class Quantised(addons.Module):
    def build(self, x):
        w = self.add_variable_input("w", lambda: np.full((3,), 2.0, np.float32), popxl.float32)
        (q,) = self.call_module(StraightThrough())(x * w)
        return q * q


def test_straight_through_child_without_aux_gives_the_estimator_gradient():
    # q = round(2x) = [0, 1, 2] for x = [0.2, 0.7, 1.1] (round half up); d(q*q)/dx through the
    # straight-through child: 2 q * w = [0, 4, 8]; d/dw: 2 q * x = [0, 1.4, 4.4].
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.array([0.2, 0.7, 1.1], np.float32), name="x")
        facts, fwd = Quantised().create_graph(x)
        bwd = addons.autodiff(fwd)
        call = fwd.bind(facts.init()).call_with_info(x)
        grads = bwd.call(
            popxl.constant(np.ones(3, np.float32)), args=bwd.grad_graph_info.inputs_dict(call)
        )
    q, dx, dw = _run(ir, [call.outputs[0], *grads])
    np.testing.assert_array_equal(q, [0.0, 1.0, 4.0])
    np.testing.assert_array_equal(dx, [0.0, 4.0, 8.0])
    np.testing.assert_allclose(dw, [0.0, 1.4, 4.4], rtol=1e-6)


def test_return_all_grad_graphs_includes_the_intermediate_gradient_graphs():
    ir = popxl.Ir()
    with ir.main_graph:
        x = popxl.variable(np.ones(3, np.float32))
        _, fwd = Outer().create_graph(x)
        infos = popxl.transforms.autodiff(
            fwd.graph,
            called_graphs_grad_info=fwd.called_graphs_grad_info,
            return_all_grad_graphs=True,
        )
    (net_graph,) = [g for g in fwd.graph.called_graphs]
    assert set(infos) == {fwd.graph, net_graph}
    assert infos[net_graph].forward_graph is net_graph
