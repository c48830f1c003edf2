"""Remote buffers with popxl-addons: the popxl-addons remote-variables tutorial program, with
only its imports changed.

Two copies of an ``Add`` layer keep their weights in a remote buffer with two entries; the
program loads both, updates them (+1 and +2), stores them back and loads them again.
Expected: w_0 1 -> 2, output0 2 -> 3, w_1 1 -> 3, output1 2 -> 4.

Run: ``python examples/addons_remote_buffer.py``
"""

import argparse
from functools import partial

import numpy as np

import torch_popxl as popxl
import torch_popxl.addons as addons
from torch_popxl.addons.named_tensors import NamedTensors

# The tutorial program has no options; only --help is answered. Other arguments are ignored,
# so that running this file inside another program (runpy, as the tests do) ignores that
# program's command line.
if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_known_args()


class Add(addons.Module):
    def build(self, x: popxl.Tensor):
        w = self.add_variable_input("weight", partial(np.ones, x.shape), x.dtype)
        x = popxl.ops.add(w, x)
        return x


ir = popxl.Ir()
with ir.main_graph, popxl.in_sequence(True):
    # ----- Create a single add graph -----
    data = np.ones((5,), dtype=np.float32)
    x = popxl.constant(data)
    facts, graph = Add().create_graph(x.spec)

    # ----- Create NamedRemoteBuffers -----
    # We use two entries since we want to have two copies of the layer,
    # referencing different remote variables
    entries = 2
    buffers = addons.named_variable_buffers(
        facts, entries=entries, sharded_threshold=10
    )  # no shards

    # ----- Create create load and store graphs -----
    load_graph, names = addons.load_remote_graph(buffers, entries=entries)
    store_graph = addons.store_remote_graph(buffers, entries=entries)

    print(load_graph.print_schedule())
    print(store_graph.print_schedule())

    # ----- Initialise remote variables, both entries -----
    remote_vars_0 = facts.init_remote(buffers, 0)
    remote_vars_1 = facts.init_remote(buffers, 1)

    # ----- Load remote variables  -----
    (w_loaded_0,) = load_graph.call(0)
    (w_loaded_1,) = load_graph.call(1)

    # out streams to get the value back
    w0_initial_d2h = addons.host_store(w_loaded_0)  # expected output (all elements equal): 1
    w1_initial_d2h = addons.host_store(w_loaded_1)  # expected output (all elements equal): 1

    # ----- Bind and call  -----
    w_named_tensors_0 = NamedTensors.pack(names, (w_loaded_0,))
    w_named_tensors_1 = NamedTensors.pack(names, (w_loaded_1,))

    bound_add_0 = graph.bind(w_named_tensors_0)  # bind to first set of variables
    bound_add_1 = graph.bind(w_named_tensors_1)  # bind to second set of variables

    (x0,) = bound_add_0.call(x)
    (x1,) = bound_add_1.call(x)

    # out stream to get the value back
    x0_d2h = addons.host_store(x0)  # expected output (all elements equal): 1+1 = 2
    x1_d2h = addons.host_store(x1)  # expected output (all elements equal): 1+1 = 2

    # ----- Modify weights  -----
    update_val = np.full((5,), 1.0, dtype=np.float32)

    updater0 = popxl.constant(update_val)  # now first layer has w = 2
    updater1 = popxl.constant(2 * update_val)  # now second layer has w = 3

    w_loaded_0 += updater0
    w_loaded_1 += updater1

    # store the new weights into buffer
    store_graph.bind(w_named_tensors_0).call(0)
    store_graph.bind(w_named_tensors_1).call(1)

    # load again and check that the buffer contains the updated value
    (w_loaded_0,) = load_graph.call(0)
    (x0_new,) = bound_add_0.call(x)
    (w_loaded_1,) = load_graph.call(1)
    (x1_new,) = bound_add_1.call(x)

    # out stream to get the value back
    w0_after_d2h = addons.host_store(w_loaded_0)  # expected output (all elements equal): 2
    x0_new_d2h = addons.host_store(x0_new)  # expected output (all elements equal): 1+2 = 3
    w1_after_d2h = addons.host_store(w_loaded_1)  # expected output (all elements equal): 3
    x1_new_d2h = addons.host_store(x1_new)  # expected output (all elements equal): 1+3 = 4

with popxl.Session(ir, "ipu_hw") as session:
    outputs = session.run()

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
