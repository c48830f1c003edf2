"""Basic MNIST in PopXL: the program of the PopXL "MNIST" user guide, trained with SGD.

Shows the core of PopXL: two linear layers built as subgraphs (``ir.create_graph``) and called
with ``ops.call_with_info``, their gradients built with ``transforms.autodiff`` (both styles of
reading them back), host streams feeding the data, and a training and a test ``Session``
sharing the weights. Only the imports differ from a PopXL program: ``import torch_popxl as
popxl``. One epoch reaches about 95% test accuracy.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
import torch_popxl.ops as ops  # noqa: E402
import torch_popxl.transforms as transforms  # noqa: E402
from common import add_data_dir_argument, example_parser, load_mnist_or_exit, mnist_arrays  # noqa: E402


class Linear(popxl.Module):
    def __init__(self) -> None:
        self.W: popxl.Tensor | None = None
        self.b: popxl.Tensor | None = None

    def build(
        self, x: popxl.Tensor, out_features: int, bias: bool = True, gelu: bool = True
    ) -> popxl.Tensor:
        self.W = popxl.graph_input((x.shape[-1], out_features), popxl.float32, "W")
        y = x @ self.W
        if bias:
            self.b = popxl.graph_input((out_features,), popxl.float32, "b")
            y = y + self.b
        if gelu:
            y = ops.gelu(y)
        return y


def create_network_fwd_graph(ir: popxl.Ir, x: popxl.Tensor):
    """Two linear layers; returns the variables, the logits and the call-site infos."""
    x = x.reshape((-1, 28 * 28))
    rng = np.random.default_rng(0)
    W0 = popxl.variable(rng.normal(0, 0.02, (x.shape[-1], 32)).astype(np.float32), name="W0")
    b0 = popxl.variable(rng.normal(0, 0.02, (32,)).astype(np.float32), name="b0")
    W1 = popxl.variable(rng.normal(0, 0.02, (32, 10)).astype(np.float32), name="W1")
    b1 = popxl.variable(rng.normal(0, 0.02, (10,)).astype(np.float32), name="b1")

    linear_0 = Linear()
    linear_graph_0 = ir.create_graph(linear_0, x, out_features=32)
    fwd_call_info_0 = ops.call_with_info(
        linear_graph_0, x, inputs_dict={linear_0.W: W0, linear_0.b: b0}
    )
    x1 = fwd_call_info_0.outputs[0]

    linear_1 = Linear()
    linear_graph_1 = ir.create_graph(linear_1, x1, out_features=10, gelu=False)
    fwd_call_info_1 = ops.call_with_info(
        linear_graph_1, x1, inputs_dict={linear_1.W: W1, linear_1.b: b1}
    )
    y = fwd_call_info_1.outputs[0]

    variables = {"W0": W0, "b0": b0, "W1": W1, "b1": b1}
    graphs = (linear_graph_0, linear_graph_1)
    call_infos = (fwd_call_info_0, fwd_call_info_1)
    return variables, x1, y, graphs, call_infos


def calculate_grads(dy, variables, x1, graphs, call_infos):
    """Backward through both layers, using the two autodiff styles of the guide."""
    linear_graph_0, linear_graph_1 = graphs
    fwd_call_info_0, fwd_call_info_1 = call_infos

    # Layer 1: gradients of every input, read back through the call-site maps.
    bwd_graph_info_1 = transforms.autodiff(linear_graph_1)
    activations_1 = bwd_graph_info_1.inputs_dict(fwd_call_info_1)
    grads_1_call_info = ops.call_with_info(bwd_graph_info_1.graph, dy, inputs_dict=activations_1)
    grads_1 = bwd_graph_info_1.fwd_parent_ins_to_grad_parent_outs(
        fwd_call_info_1, grads_1_call_info
    )
    grad_x_1 = grads_1[x1]

    # Layer 0: only the weight and bias gradients, returned directly by the call.
    linear_0_W, linear_0_b = linear_graph_0.inputs[1], linear_graph_0.inputs[2]
    bwd_graph_info_0 = transforms.autodiff(linear_graph_0, grads_required=[linear_0_W, linear_0_b])
    activations_0 = bwd_graph_info_0.inputs_dict(fwd_call_info_0)
    grad_w_0, grad_b_0 = ops.call(bwd_graph_info_0.graph, grad_x_1, inputs_dict=activations_0)

    return {
        "W0": grad_w_0,
        "b0": grad_b_0,
        "W1": grads_1[variables["W1"]],
        "b1": grads_1[variables["b1"]],
    }


def build_train_ir(batch_size: int, lr: float):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        img_stream = popxl.h2d_stream((batch_size, 28, 28), popxl.float32, "image")
        label_stream = popxl.h2d_stream((batch_size,), popxl.int32, "labels")
        x = ops.host_load(img_stream, "x")
        labels = ops.host_load(label_stream, "labels")

        variables, x1, y, graphs, call_infos = create_network_fwd_graph(ir, x)
        probs = ops.softmax(y, axis=1)
        loss, dy = ops.nll_loss_with_softmax_grad(probs, labels)
        grads = calculate_grads(dy, variables, x1, graphs, call_infos)
        for name, var in variables.items():
            ops.scaled_add_(var, grads[name], b=-lr)

        loss_stream = popxl.d2h_stream(loss.shape, loss.dtype, "loss")
        ops.host_store(loss_stream, loss)
    return ir, (img_stream, label_stream), variables, loss_stream


def build_test_ir(batch_size: int):
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence():
        img_stream = popxl.h2d_stream((batch_size, 28, 28), popxl.float32, "image")
        x = ops.host_load(img_stream, "x")
        variables, _, y, _, _ = create_network_fwd_graph(ir, x)
        out_stream = popxl.d2h_stream(y.shape, y.dtype, "outputs")
        ops.host_store(out_stream, y)
    return ir, img_stream, variables, out_stream


def train(args, x_train, y_train) -> dict:
    ir, (img_stream, label_stream), variables, loss_stream = build_train_ir(
        args.batch_size, args.lr
    )
    session = popxl.Session(ir, "ipu_hw")
    num_batches = len(x_train) // args.batch_size
    if args.max_steps:
        num_batches = min(num_batches, args.max_steps)
    images = x_train.reshape(-1, 28, 28)
    with session:
        for epoch in range(args.epochs):
            order = np.random.default_rng(epoch).permutation(len(x_train))
            bar = tqdm(
                range(num_batches), desc=f"epoch {epoch}", disable=args.quiet, mininterval=1.0
            )
            for i in bar:
                idx = order[i * args.batch_size : (i + 1) * args.batch_size]
                out = session.run({img_stream: images[idx], label_stream: y_train[idx]})
                if i % 100 == 0:
                    bar.set_postfix(loss=f"{float(out[loss_stream]):.4f}")
        trained = session.get_tensors_data(list(variables.values()))
    train.report = session.memory_report()
    return {name: trained[v] for name, v in variables.items()}


def test(args, trained: dict, x_test, y_test) -> float:
    ir, img_stream, variables, out_stream = build_test_ir(args.test_batch_size)
    session = popxl.Session(ir, "ipu_hw")
    session.write_variables_data({variables[name]: data for name, data in trained.items()})
    images = x_test.reshape(-1, 28, 28)
    num_batches = len(x_test) // args.test_batch_size
    correct = 0
    with session:
        for i in range(num_batches):
            sl = slice(i * args.test_batch_size, (i + 1) * args.test_batch_size)
            logits = session.run({img_stream: images[sl]})[out_stream]
            correct += int((logits.argmax(-1) == y_test[sl]).sum())
    return correct / (num_batches * args.test_batch_size)


def main(argv=None) -> float:
    parser = example_parser(__doc__)
    parser.add_argument("--batch-size", type=int, default=8, help="training batch size")
    parser.add_argument("--test-batch-size", type=int, default=80, help="test batch size")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training set")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument(
        "--max-steps", type=int, default=0, help="stop each epoch after this many steps (0: all)"
    )
    add_data_dir_argument(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    x_train, y_train, x_test, y_test = load_mnist_or_exit(mnist_arrays, args.data_dir)
    start = time.time()
    trained = train(args, x_train, y_train)
    acc = test(args, trained, x_test, y_test)
    print(f"test accuracy: {acc * 100:.2f}%  ({time.time() - start:.1f} s)")
    print(train.report)
    return acc


if __name__ == "__main__":
    main()
