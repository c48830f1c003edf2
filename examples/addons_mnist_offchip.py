"""MNIST with off-chip (remote), replica-sharded Adam state, written with popxl-addons.

The popxl-addons tutorial "Remote variables and RTS", run on the torch_popxl simulator with
only the imports changed, plus a command line and local data loading:

* 4-layer MLP 784-512-512-512-10 with GELU, built with ``addons.Module``;
* data parallel over ``--data-parallel`` replicas, gradient accumulation over
  ``--gradient-accumulation`` micro-batches (running-mean accumulators);
* gradients reduced with ``reduce_replica_sharded_graph`` (reduce-scatter for tensors with at
  least ``--sharded-threshold`` elements), variables sliced to shards, and one Adam graph per
  variable whose state lives in remote buffers (sharded the same way), loaded and stored
  around each update; updated shards are all-gathered back into the full weights.

Data: MNIST from ``--data-dir``, ``$TORCH_POPXL_MNIST_DIR`` or the user cache, downloaded into
the cache if absent (``examples/common.py``); the same values as the tutorial's
``torchvision.datasets.MNIST`` with ``ToTensor()`` and ``Normalize``.

Run: ``python examples/addons_mnist_offchip.py``
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import HelpFormatter, add_data_dir_argument, load_mnist_or_exit, mnist_tensor_datasets  # noqa: E402

import torch_popxl as popxl  # noqa: E402
import torch_popxl.addons as addons  # noqa: E402
import torch_popxl.ops as ops  # noqa: E402
from torch_popxl.addons.named_tensors import NamedTensors  # noqa: E402
from torch_popxl.addons.rts import reduce_replica_sharded_graph, replica_sharded_spec  # noqa: E402

np.random.seed(42)


# ---- data -----------------------------------------------------------------------------------


def get_mnist_data(test_batch_size: int, batch_size: int, data_dir: str | None):
    train, test = load_mnist_or_exit(mnist_tensor_datasets, data_dir)
    training_data = torch.utils.data.DataLoader(
        train, batch_size=batch_size, shuffle=True, drop_last=True
    )
    validation_data = torch.utils.data.DataLoader(
        test, batch_size=test_batch_size, shuffle=True, drop_last=True
    )
    return training_data, validation_data


def accuracy(predictions: np.ndarray, labels) -> float:
    ind = np.argmax(predictions, axis=-1).flatten()
    labels = labels.detach().numpy().flatten()
    return np.mean(ind == labels) * 100.0


# ---- model (as in the tutorial) -------------------------------------------------------------


class Linear(addons.Module):
    def __init__(self, out_features: int, bias: bool = True):
        super().__init__()
        self.out_features = out_features
        self.bias = bias

    def build(self, x: popxl.Tensor) -> popxl.Tensor:
        # add a state variable to the module
        w = self.add_variable_input(
            "weight",
            partial(np.random.normal, 0, 0.02, (x.shape[-1], self.out_features)),
            x.dtype,
        )
        y = x @ w
        if self.bias:
            # add a state variable to the module
            b = self.add_variable_input("bias", partial(np.zeros, y.shape[-1]), x.dtype)
            y = y + b
        return y


class Net(addons.Module):
    def __init__(self, cache: addons.GraphCache | None = None):
        super().__init__(cache=cache)
        self.fc1 = Linear(512)
        self.fc2 = Linear(512)
        self.fc3 = Linear(512)
        self.fc4 = Linear(10)

    def build(self, x: popxl.Tensor):
        x = x.reshape((-1, 28 * 28))
        x = ops.gelu(self.fc1(x))
        x = ops.gelu(self.fc2(x))
        x = ops.gelu(self.fc3(x))
        x = self.fc4(x)
        return x


# ---- options --------------------------------------------------------------------------------


@dataclass
class Train:
    micro_batch_size: int = 8
    lr: float | popxl.Tensor = 1e-3
    epochs: int = 1
    gradient_accumulation: int = 8
    data_parallel: int = 4
    device = "ipu_hw"
    sharded_threshold: int = 512


@dataclass
class Test:
    micro_batch_size: int = 80
    device = "ipu_hw"


class Options:
    def __init__(self) -> None:
        self.train = Train()
        self.test = Test()


# ---- optimizer with off-chip state ----------------------------------------------------------


class Adam(addons.Module):
    # we need to specify in_sequence because a lot of operations are in place and their order
    # shouldn't be rearranged
    @popxl.in_sequence()
    def build(
        self,
        var: popxl.TensorByRef,
        grad: popxl.Tensor,
        *,
        lr: float | popxl.Tensor,
        beta1: float | popxl.Tensor = 0.9,
        beta2: float | popxl.Tensor = 0.999,
        eps: float | popxl.Tensor = 1e-5,
        weight_decay: float | popxl.Tensor = 0.0,
        first_order_dtype: popxl.dtype = popxl.float16,
        bias_correction: bool = True,
    ):
        # gradient estimators for the variable var - same shape as the variable

        # Sharded inputs must be added with add_replica_sharded_variable_input
        if var.meta_shape:
            first_order = self.add_replica_sharded_variable_input(
                "first_order", partial(np.zeros, var.meta_shape), first_order_dtype, by_ref=True
            )
            second_order = self.add_replica_sharded_variable_input(
                "second_order", partial(np.zeros, var.meta_shape), popxl.float32, by_ref=True
            )
        else:
            first_order = self.add_variable_input(
                "first_order", partial(np.zeros, var.shape), first_order_dtype, by_ref=True
            )
            second_order = self.add_variable_input(
                "second_order", partial(np.zeros, var.shape), popxl.float32, by_ref=True
            )

        ops.var_updates.accumulate_moving_average_(first_order, grad, f=beta1)
        ops.var_updates.accumulate_moving_average_square_(second_order, grad, f=beta2)

        # adam is a biased estimator: provide the step to correct bias
        step = None
        if bias_correction:
            step = self.add_variable_input(
                "step", partial(np.zeros, ()), popxl.float32, by_ref=True
            )

        # calculate the weight increment with adam heuristic
        updater = ops.var_updates.adam_updater(
            first_order,
            second_order,
            weight=var,
            weight_decay=weight_decay,
            time_step=step,
            beta1=beta1,
            beta2=beta2,
            epsilon=eps,
        )

        # in place weight update: w += (-lr)*dw
        ops.scaled_add_(var, updater, b=-lr)


def remote_step(var: popxl.Tensor, grad: popxl.Tensor, optimizer: addons.Module, opts):
    """Optimizer step with off-chip state: load state, call the optimizer, store the state."""
    facts, opt_graph = optimizer.create_graph(
        replica_sharded_spec(var, threshold=opts.train.sharded_threshold),
        replica_sharded_spec(grad, threshold=opts.train.sharded_threshold),
        lr=opts.train.lr,
    )

    # keep the state of the optimizer in remote buffers
    buffers = addons.named_variable_buffers(
        facts, entries=1, sharded_threshold=opts.train.sharded_threshold
    )
    # create graph for loading the state
    opt_load, names = addons.load_remote_graph(buffers, entries=1)
    # create graph for storing the state after it is updated
    opt_store = addons.store_remote_graph(buffers, entries=1)

    # init the buffer
    state = facts.init_remote(buffers)
    # load remote variables: remote buffer -> device memory
    loaded_state = opt_load.call(0)
    state = NamedTensors.from_dict(dict(zip(names, loaded_state, strict=True)))

    # bind optimizer to loaded vars and call optimizer
    opt_graph.bind(state).call(var, grad)

    # bind store graph to loaded vars and store remote variables: device memory -> remote buffer
    opt_store.bind(state).call(0)


def optimizer_step(
    variables: NamedTensors, grads: dict, optimizer: addons.Module, accum_counter, opts
):
    """Update all variables, one optimizer graph per variable."""
    for _, var in variables.named_tensors.items():
        remote_step(var, grads[var], optimizer, opts)

    if accum_counter is not None:
        # Reset accumulators.
        ops.var_updates.accumulator_scale_(accum_counter, 0.0)


# ---- programs -------------------------------------------------------------------------------


def train_program(opts, executor: str = "fast"):
    ir = popxl.Ir()
    ir.replication_factor = opts.train.data_parallel

    with ir.main_graph:
        # ----- Streams  -----
        img_spec = popxl.TensorSpec((opts.train.micro_batch_size, 28, 28), popxl.float32)

        img_stream = popxl.h2d_stream(img_spec.shape, popxl.float32, "image")
        label_stream = popxl.h2d_stream((opts.train.micro_batch_size,), popxl.int32, "labels")
        loss_stream = popxl.d2h_stream((), popxl.float32, "loss")

        # ----- Create graphs  -----
        facts, fwd_graph = Net().create_graph(img_spec)
        variables = facts.init()
        bound_fwd = fwd_graph.bind(variables)

        counter = None
        required_grads = fwd_graph.args.tensors

        if opts.train.gradient_accumulation > 1:
            bwd_facts, bwd_graph = addons.autodiff_with_accumulation(fwd_graph, required_grads)
            accumulated_grads = bwd_facts.init()
            counter = accumulated_grads.mean_accum_counter
            bound_bwd = bwd_graph.bind(accumulated_grads)
        else:
            bwd_graph = addons.autodiff(fwd_graph, grads_required=required_grads)

        # ----- Gradient accumulation loop  -----
        with popxl.in_sequence(True):
            for _ in range(opts.train.gradient_accumulation):
                # ----- Load data  -----
                img_t = ops.host_load(img_stream)
                labels = ops.host_load(label_stream, "labels")

                # ----- Fwd  -----
                # full weights are used, we are not sharding the network weights
                fwd_info = bound_fwd.call_with_info(img_t)
                x = fwd_info.outputs[0]

                # ----- Loss  -----
                loss, dx = addons.ops.cross_entropy_with_grad(x, labels)
                ops.host_store(loss_stream, loss)

                # ----- Bwd  -----
                activations = bwd_graph.grad_graph_info.inputs_dict(fwd_info)
                if opts.train.gradient_accumulation > 1:
                    # full weights, we are not sharding the backward accumulators
                    bound_bwd.call(dx, args=activations)
                    grads = accumulated_grads.tensors[:-1]  # exclude the counter
                else:
                    grads = bwd_graph.call(dx, args=activations)

            if opts.train.data_parallel > 1:
                # ----- Reduce and shard gradients  -----
                if opts.train.gradient_accumulation > 1:
                    keys = [n for n in accumulated_grads.named_tensors if n != "mean_accum_counter"]
                else:
                    keys = list(fwd_graph.args.named_tensors)
                grads = NamedTensors.pack(keys, grads)
                # tensors whose elements exceed threshold will be reduce_scattered -> sharded
                grad_reduce, names = reduce_replica_sharded_graph(
                    grads, "mean", threshold=opts.train.sharded_threshold
                )
                grads = grad_reduce.bind(grads).call()

                # ----- Shard forward variables  -----
                sharded_vars = []
                names = []
                for name, v in variables.named_tensors.items():
                    ir = popxl.gcg().ir
                    if (
                        v.nelms >= opts.train.sharded_threshold
                        and v.nelms % ir.replication_factor == 0
                    ):
                        shard = ops.collectives.replica_sharded_slice(v)
                    else:
                        shard = v

                    sharded_vars.append(shard)
                    names.append(name)

                sharded_vars = NamedTensors.pack(names, sharded_vars)
            else:
                sharded_vars = variables

            # ----- Optimizer  -----
            grads_dict = dict(zip(sharded_vars.tensors, grads, strict=True))
            optimizer = Adam(cache=True)
            # the optimizer step will update the shards in place (sharded vars are TensorByRef inputs)
            optimizer_step(sharded_vars, grads_dict, optimizer, counter, opts)

            # gather shards and copy into full tensor
            if opts.train.data_parallel > 1:
                for i, v in enumerate(sharded_vars.tensors):
                    if v.meta_shape:
                        # we need to gather the updated shards
                        v_full = ops.collectives.replicated_all_gather(v)
                        # and copy the updated value in the original full tensor
                        ops.var_updates.copy_var_update_(variables.tensors[i], v_full)

    ir.num_host_transfers = opts.train.gradient_accumulation
    return (
        popxl.Session(ir, opts.train.device, executor=executor),
        [img_stream, label_stream],
        variables,
        loss_stream,
    )


def test_program(test_batch_size, device, executor: str = "fast"):
    ir = popxl.Ir(replication=1)
    with ir.main_graph:
        # Inputs
        in_stream = popxl.h2d_stream((test_batch_size, 28, 28), popxl.float32, "image")
        in_t = ops.host_load(in_stream)

        # Create graphs
        facts, graph = Net().create_graph(in_t)

        # Initialise variables
        variables = facts.init()

        # Forward
        (outputs,) = graph.bind(variables).call(in_t)
        out_stream = popxl.d2h_stream(outputs.shape, outputs.dtype, "outputs")
        ops.host_store(out_stream, outputs)

    ir.num_host_transfers = 1
    return popxl.Session(ir, device, executor=executor), [in_stream], variables, out_stream


def evaluate_throughput(session, samples_per_step, epochs: int = 5):
    inputs = {
        stream: np.ones(session._full_input_shape(stream.shape), stream.dtype.as_numpy())
        for stream in session.expected_inputs()
    }

    durations = []
    with session:
        for _ in range(epochs):
            start = time.time()
            session.run(inputs)
            durations.append(time.time() - start)

    duration = np.mean(durations)
    print(f"Mean duration: {duration} s Throughput: {samples_per_step / duration:6.1f} samples/s ")


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--train-micro-batch-size", type=int, default=8, help="micro-batch size per replica"
    )
    parser.add_argument("--test-batch-size", type=int, default=80, help="test batch size")
    parser.add_argument("--epochs", type=int, default=1, help="training epochs")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    parser.add_argument("--data-parallel", type=int, default=4, help="number of replicas")
    parser.add_argument(
        "--gradient-accumulation", type=int, default=8, help="micro-batches per step"
    )
    parser.add_argument("--sharded-threshold", type=int, default=512,
                        help="tensors with at least this many elements are sharded")  # fmt: skip
    add_data_dir_argument(parser)
    parser.add_argument(
        "--limit-batches", type=int, default=None, help="train on at most this many steps"
    )
    parser.add_argument(
        "--executor", choices=("fast", "reference"), default="fast", help="simulator executor"
    )
    parser.add_argument(
        "--throughput", action="store_true", help="also time 5 steps on synthetic data"
    )
    return parser.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    opts = Options()
    opts.train.micro_batch_size = args.train_micro_batch_size
    opts.train.lr = args.lr
    opts.train.epochs = args.epochs
    opts.train.gradient_accumulation = args.gradient_accumulation
    opts.train.data_parallel = args.data_parallel
    opts.train.sharded_threshold = args.sharded_threshold
    opts.test.micro_batch_size = args.test_batch_size

    global_batch_size = (
        opts.train.micro_batch_size * opts.train.gradient_accumulation * opts.train.data_parallel
    )
    training_data, test_data = get_mnist_data(
        opts.test.micro_batch_size, global_batch_size, args.data_dir
    )

    start = time.time()
    train_session, train_input_streams, train_variables, loss_stream = train_program(
        opts, args.executor
    )
    print(f"Built the training program in {time.time() - start:.1f}s")

    start = time.time()
    with train_session:
        nr_batches = len(training_data)
        if args.limit_batches is not None:
            nr_batches = min(nr_batches, args.limit_batches)
        for epoch in range(1, opts.train.epochs + 1):
            print(f"Epoch {epoch}/{opts.train.epochs}")
            bar = tqdm(training_data, total=nr_batches)
            for step, (data, labels) in enumerate(bar):
                if step >= nr_batches:
                    break
                # reshape data accounting for replication and num hosts transfers
                data = data.reshape(
                    train_session.ir.num_host_transfers,
                    train_session.ir.replication_factor,
                    opts.train.micro_batch_size,
                    28,
                    28,
                ).squeeze()
                labels = labels.reshape(
                    train_session.ir.num_host_transfers,
                    train_session.ir.replication_factor,
                    opts.train.micro_batch_size,
                ).squeeze()

                inputs: Mapping[popxl.HostToDeviceStream, np.ndarray] = dict(
                    zip(train_input_streams, [data.squeeze().float(), labels.int()], strict=True)
                )
                loss = train_session.run(inputs)
                losses_np = loss[
                    loss_stream
                ]  # shape(ir.num_host_transfers, ir.replication_factor, )
                avg_loss = np.mean(losses_np)
                bar.set_description(f"Loss:{avg_loss:0.4f}")
    train_seconds = time.time() - start
    print(
        f"Training took {train_seconds:.1f}s ({train_seconds / max(nr_batches * opts.train.epochs, 1) * 1e3:.0f} ms/step)"
    )

    # get weights data : dictionary { train_session variables : tensor data (numpy) }
    train_vars_to_data = train_session.get_tensors_data(train_variables.tensors)

    # Create test program and test session
    test_session, test_input_streams, test_variables, out_stream = test_program(
        opts.test.micro_batch_size, opts.test.device, args.executor
    )

    # dictionary { train_session variables : test_session variables }
    train_vars_to_test_vars = train_variables.to_mapping(test_variables)

    # Create a dictionary { test_session variables : tensor data (numpy) }
    test_vars_to_data = {
        test_var: train_vars_to_data[train_var].copy()
        for train_var, test_var in train_vars_to_test_vars.items()
    }

    # Copy trained weights to the program, with a single host to device transfer at the end
    test_session.write_variables_data(test_vars_to_data)

    if args.throughput:
        print("train session")
        evaluate_throughput(train_session, global_batch_size)

    nr_batches = len(test_data)
    sum_acc = 0.0
    with test_session:
        for data, labels in tqdm(test_data, total=nr_batches):
            # the test program loads the images only; the labels score its output here
            inputs = dict(zip(test_input_streams, [data.squeeze().float()], strict=True))
            output = test_session.run(inputs)
            sum_acc += accuracy(output[out_stream], labels)
    test_accuracy = sum_acc / len(test_data)
    print(f"Accuracy on test set: {test_accuracy:0.2f}%")

    if args.throughput:
        print("test session")
        evaluate_throughput(test_session, opts.test.micro_batch_size)

    report = getattr(train_session, "memory_report", None)
    if callable(report):
        print(report())
    return test_accuracy


if __name__ == "__main__":
    main()
