"""MNIST with replicas and replicated tensor sharding (RTS): PopXL's data-parallel MNIST.

``W0`` is a ``replica_sharded_variable`` (its shard stays on chip), ``W1`` a
``remote_replica_sharded_variable`` (its shard lives in streaming memory and is loaded and
stored around the update). Each step gathers the full weights, runs the two linear layers,
reduce-scatters the weight gradients (mean over replicas) onto the shards, all-reduces the
bias gradients and updates with SGD. With replication factor 1 the weights are plain variables.

Data parallelism does not change the maths: ``--replication-factor 2 --batch-size 4`` reaches
an accuracy similar to ``--replication-factor 1 --batch-size 8`` (the same global batch).
"""

from __future__ import annotations

import sys
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
import torch_popxl.ops as ops  # noqa: E402
import torch_popxl.transforms as transforms  # noqa: E402
from common import add_data_dir_argument, example_parser, load_mnist_or_exit, mnist_arrays  # noqa: E402

# var: the host handle; shards: the on-device shard; full: the gathered weight;
# remote_buffer: the buffer holding the shard when it lives off chip.
Trainable = namedtuple("Trainable", ["var", "shards", "full", "remote_buffer"])


class Linear(popxl.Module):
    def __init__(self) -> None:
        self.W: popxl.Tensor | None = None
        self.b: popxl.Tensor | None = None

    def build(self, x: popxl.Tensor, out_features: int, gelu: bool = True) -> popxl.Tensor:
        self.W = popxl.graph_input((x.shape[-1], out_features), popxl.float32, "W")
        self.b = popxl.graph_input((out_features,), popxl.float32, "b")
        y = x @ self.W + self.b
        return ops.gelu(y) if gelu else y


def make_trainable(name: str, data: np.ndarray, rts: str | None) -> Trainable:
    if rts == "on_chip":
        var, shard = popxl.replica_sharded_variable(data, popxl.float32, name)
        return Trainable(var, shard, ops.collectives.replicated_all_gather(shard), None)
    if rts == "remote":
        buffer = popxl.replica_sharded_buffer(data.shape, popxl.float32)
        var = popxl.remote_replica_sharded_variable(data, buffer, 0, name=name)
        shard = ops.remote_load(buffer, 0, name + "_shard")
        return Trainable(var, shard, ops.collectives.replicated_all_gather(shard), buffer)
    var = popxl.variable(data, popxl.float32, name)
    return Trainable(var, None, var, None)


def create_network(ir: popxl.Ir, x: popxl.Tensor, sharded: bool):
    x = x.reshape((-1, 28 * 28))
    rng = np.random.default_rng(0)
    params = {
        "W0": make_trainable("W0", rng.normal(0, 0.02, (784, 32)).astype(np.float32), "on_chip" if sharded else None),
        "b0": make_trainable("b0", rng.normal(0, 0.02, (32,)).astype(np.float32), None),
        "W1": make_trainable("W1", rng.normal(0, 0.02, (32, 10)).astype(np.float32), "remote" if sharded else None),
        "b1": make_trainable("b1", rng.normal(0, 0.02, (10,)).astype(np.float32), None),
    }  # fmt: skip
    layer0, layer1 = Linear(), Linear()
    graph0 = ir.create_graph(layer0, x, out_features=32)
    info0 = ops.call_with_info(
        graph0, x, inputs_dict={layer0.W: params["W0"].full, layer0.b: params["b0"].full}
    )
    x1 = info0.outputs[0]
    graph1 = ir.create_graph(layer1, x1, out_features=10, gelu=False)
    info1 = ops.call_with_info(
        graph1, x1, inputs_dict={layer1.W: params["W1"].full, layer1.b: params["b1"].full}
    )
    return params, x1, info1.outputs[0], (graph0, graph1), (info0, info1)


def train_step(ir, params, x1, dy, graphs, infos, lr: float, replicas: int) -> None:
    graph0, graph1 = graphs
    info0, info1 = infos
    bwd1 = transforms.autodiff(graph1)
    call1 = ops.call_with_info(bwd1.graph, dy, inputs_dict=bwd1.inputs_dict(info1))
    grads1 = bwd1.fwd_parent_ins_to_grad_parent_outs(info1, call1)
    bwd0 = transforms.autodiff(graph0, grads_required=list(graph0.inputs[1:]))
    grad_w0, grad_b0 = ops.call(bwd0.graph, grads1[x1], inputs_dict=bwd0.inputs_dict(info0))
    grads = {
        "W0": grad_w0,
        "b0": grad_b0,
        "W1": grads1[params["W1"].full],
        "b1": grads1[params["b1"].full],
    }
    for name, p in params.items():
        g = grads[name]
        if p.shards is not None:
            # Mean over replicas, scattered so each replica gets the gradient of its shard.
            g = ops.collectives.replicated_reduce_scatter(
                g, "mean", configure_output_for_replicated_tensor_sharding=True
            )
            ops.scaled_add_(p.shards, g, b=-lr)
            if p.remote_buffer is not None:
                ops.remote_store(p.remote_buffer, 0, p.shards)
        else:
            if replicas > 1:
                g = ops.collectives.replicated_all_reduce(g, "mean")
            ops.scaled_add_(p.var, g, b=-lr)


def build_train_ir(batch_size: int, replicas: int, lr: float):
    ir = popxl.Ir(replication=replicas)
    with ir.main_graph, popxl.in_sequence():
        img_stream = popxl.h2d_stream((batch_size, 28, 28), popxl.float32, "image")
        label_stream = popxl.h2d_stream((batch_size,), popxl.int32, "labels")
        x = ops.host_load(img_stream, "x")
        labels = ops.host_load(label_stream, "labels")
        params, x1, y, graphs, infos = create_network(ir, x, sharded=replicas > 1)
        loss, dy = ops.nll_loss_with_softmax_grad(ops.softmax(y, axis=1), labels)
        train_step(ir, params, x1, dy, graphs, infos, lr, replicas)
        loss_stream = popxl.d2h_stream(loss.shape, loss.dtype, "loss")
        ops.host_store(loss_stream, loss)
    return ir, (img_stream, label_stream), params, loss_stream


def build_test_ir(batch_size: int, replicas: int):
    ir = popxl.Ir(replication=replicas)
    with ir.main_graph, popxl.in_sequence():
        img_stream = popxl.h2d_stream((batch_size, 28, 28), popxl.float32, "image")
        params, _, y, _, _ = create_network(
            ir, ops.host_load(img_stream, "x"), sharded=replicas > 1
        )
        out_stream = popxl.d2h_stream(y.shape, y.dtype, "outputs")
        ops.host_store(out_stream, y)
    return ir, img_stream, params, out_stream


def _replicated(a: np.ndarray, replicas: int) -> np.ndarray:
    return a.reshape(replicas, -1, *a.shape[1:]) if replicas > 1 else a


def main(argv=None) -> float:
    parser = example_parser(__doc__)
    parser.add_argument(
        "--replication-factor", type=int, default=1, help="data-parallel replicas (1: no RTS)"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="micro-batch per replica")
    parser.add_argument("--test-batch-size", type=int, default=80, help="test batch size")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training set")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    parser.add_argument(
        "--max-steps", type=int, default=0, help="stop after this many steps (0: a full epoch)"
    )
    add_data_dir_argument(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    R = args.replication_factor
    x_train, y_train, x_test, y_test = load_mnist_or_exit(mnist_arrays, args.data_dir)
    images, test_images = x_train.reshape(-1, 28, 28), x_test.reshape(-1, 28, 28)
    global_batch = args.batch_size * R
    start = time.time()

    ir, (img_stream, label_stream), params, loss_stream = build_train_ir(
        args.batch_size, R, args.lr
    )
    session = popxl.Session(ir, "ipu_hw")
    steps = len(x_train) // global_batch
    if args.max_steps:
        steps = min(steps, args.max_steps)
    with session:
        for epoch in range(args.epochs):
            order = np.random.default_rng(epoch).permutation(len(x_train))
            bar = tqdm(range(steps), desc=f"epoch {epoch}", disable=args.quiet, mininterval=1.0)
            for i in bar:
                idx = order[i * global_batch : (i + 1) * global_batch]
                out = session.run(
                    {
                        img_stream: _replicated(images[idx], R),
                        label_stream: _replicated(y_train[idx], R),
                    }
                )
                if i % 100 == 0:
                    bar.set_postfix(loss=f"{float(np.mean(out[loss_stream])):.4f}")
        trained = session.get_tensors_data([p.var for p in params.values()])
    report = session.memory_report()

    test_global = args.test_batch_size * R
    test_ir, test_stream, test_params, out_stream = build_test_ir(args.test_batch_size, R)
    test_session = popxl.Session(test_ir, "ipu_hw")
    test_session.write_variables_data(
        {test_params[n].var: trained[p.var] for n, p in params.items()}
    )
    correct = total = 0
    with test_session:
        for i in range(len(x_test) // test_global):
            sl = slice(i * test_global, (i + 1) * test_global)
            logits = test_session.run({test_stream: _replicated(test_images[sl], R)})[out_stream]
            correct += int((logits.reshape(-1, 10).argmax(-1) == y_test[sl]).sum())
            total += test_global
    acc = correct / total
    print(f"replication factor {R}, batch {args.batch_size} per replica: test accuracy {acc * 100:.2f}%  "
          f"({time.time() - start:.1f} s)")  # fmt: skip
    print(report)
    return acc


if __name__ == "__main__":
    main()
