"""Remote buffers in plain PopXL: two ``Add`` layers whose weights share one remote buffer.

The popxl-addons tutorial builds this with ``addons.Module`` and ``named_variable_buffers``;
this is the same program in plain PopXL: one buffer with two entries, a load graph and a
store graph taking the entry index, and the layer graph called with each loaded weight.

Expected output (every element): w_0 1 -> 2, output0 2 -> 3, w_1 1 -> 3, output1 2 -> 4.

Run: ``.venv/bin/python examples/remote_buffer.py``
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch_popxl as popxl  # noqa: E402
import torch_popxl.ops as ops  # noqa: E402
from common import example_parser  # noqa: E402


def add(x: popxl.Tensor, w: popxl.Tensor) -> popxl.Tensor:
    return ops.add(w, x)


def main() -> None:
    ir = popxl.Ir()
    with ir.main_graph, popxl.in_sequence(True):
        x = popxl.constant(np.ones((5,), dtype=np.float32), name="x")
        add_graph = ir.create_graph(add, x, x)

        # Two entries: one per copy of the layer, each a different remote variable.
        entries = 2
        buffer = popxl.remote_buffer((5,), popxl.float32, entries)

        def load_remote(index: popxl.Tensor) -> popxl.Tensor:
            return ops.remote_load(buffer, index, "weight")

        def store_remote(index: popxl.Tensor, weight: popxl.Tensor) -> None:
            ops.remote_store(buffer, index, weight)

        index_spec = popxl.TensorSpec((), popxl.int32)
        load_graph = ir.create_graph(load_remote, index_spec)
        store_graph = ir.create_graph(
            store_remote, index_spec, popxl.TensorSpec((5,), popxl.float32)
        )
        print(load_graph.text())
        print(store_graph.text())

        popxl.remote_variable(np.ones((5,), np.float32), buffer, 0, name="weight_0")
        popxl.remote_variable(np.ones((5,), np.float32), buffer, 1, name="weight_1")
        entry = [popxl.constant(i, popxl.int32, name=f"entry_{i}") for i in range(entries)]

        def host_store(t: popxl.Tensor):
            stream = popxl.d2h_stream(t.shape, t.dtype)
            ops.host_store(stream, t)
            return stream

        (w_loaded_0,) = ops.call(load_graph, entry[0])
        (w_loaded_1,) = ops.call(load_graph, entry[1])
        w0_initial_d2h = host_store(w_loaded_0)  # 1
        w1_initial_d2h = host_store(w_loaded_1)  # 1

        (x0,) = ops.call(add_graph, x, w_loaded_0)
        (x1,) = ops.call(add_graph, x, w_loaded_1)
        x0_d2h = host_store(x0)  # 1 + 1 = 2
        x1_d2h = host_store(x1)  # 1 + 1 = 2

        update = np.full((5,), 1.0, dtype=np.float32)
        w_loaded_0 += popxl.constant(update)  # first layer: w = 2
        w_loaded_1 += popxl.constant(2 * update)  # second layer: w = 3

        ops.call(store_graph, entry[0], w_loaded_0)
        ops.call(store_graph, entry[1], w_loaded_1)

        # Load again: the buffer holds the updated values.
        (w_loaded_0,) = ops.call(load_graph, entry[0])
        (x0_new,) = ops.call(add_graph, x, w_loaded_0)
        (w_loaded_1,) = ops.call(load_graph, entry[1])
        (x1_new,) = ops.call(add_graph, x, w_loaded_1)

        w0_after_d2h = host_store(w_loaded_0)  # 2
        x0_new_d2h = host_store(x0_new)  # 1 + 2 = 3
        w1_after_d2h = host_store(w_loaded_1)  # 3
        x1_new_d2h = host_store(x1_new)  # 1 + 3 = 4

    with popxl.Session(ir, "ipu_hw") as session:
        outputs = session.run()
        report = session.memory_report()

    print("initial values")
    print("\t w_0: ", outputs[w0_initial_d2h])
    print("\t output0: ", outputs[x0_d2h])
    print("\t w_1: ", outputs[w1_initial_d2h])
    print("\t output1: ", outputs[x1_d2h])

    print("updated values")
    print("\t w_0: ", outputs[w0_after_d2h])
    print("\t output0: ", outputs[x0_new_d2h])
    print("\t w_1: ", outputs[w1_after_d2h])
    print("\t output1: ", outputs[x1_new_d2h])

    print()
    print(report)


if __name__ == "__main__":
    example_parser(__doc__).parse_args()
    main()
