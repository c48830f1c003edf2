"""Build the C++ runtime extension ``torch_popxl._C``.

Install with ``pip install --no-build-isolation -e .`` so the extension compiles against
the torch already in the environment (an isolated build would download another torch).
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
# TORCH_POPXL_CXXFLAGS replaces the optimisation flags and TORCH_POPXL_LDFLAGS adds link flags
# (scripts/gpu_check.sh builds variants with them to diagnose another machine's toolchain).
cxx_flags = os.environ.get("TORCH_POPXL_CXXFLAGS", "-O3").split()
link_flags = os.environ.get("TORCH_POPXL_LDFLAGS", "").split()

setup(
    ext_modules=[
        CppExtension(
            "torch_popxl._C",
            sources,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
