// The extension module `torch_popxl._C` exists only so that `import torch_popxl._C` loads this
// shared library: loading it runs the static TORCH_LIBRARY registrations in the other
// translation units, which is how the ops reach Python (as torch.ops.torch_popxl.*). Going
// through the dispatcher instead of pybind11 keeps the ops visible to FakeTensor, vmap,
// autograd, make_fx and opcheck, and avoids the slow torch/extension.h header.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT,
      "_C",
      "Registers the torch.ops.torch_popxl operators (see csrc/registration.cpp).",
      -1,       // no per-module state
      nullptr,  // no methods: the ops are reached through torch.ops.torch_popxl
      nullptr,
      nullptr,
      nullptr,
      nullptr,
  };
  return PyModule_Create(&module_def);
}
