"""Build the C++ runtime extension ``torch_popxl._C``.

Install with ``pip install --no-build-isolation -e .`` so the extension compiles against
the torch already in the environment (an isolated build would download another torch).
"""

import glob
import os

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))

setup(
    ext_modules=[
        CppExtension(
            "torch_popxl._C",
            sources,
            extra_compile_args={"cxx": ["-O3"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
