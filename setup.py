"""Builds the optional C speed-up ``hookcli.engine._fastreduce`` (everything else lives in pyproject.toml).

``optional=True``: without a C compiler the install still succeeds and hookcli computes statistics
with torch reductions instead (slower on CPU, same numbers). OpenMP is used on Linux, where GCC
ships it and torch's own libgomp is the one loaded at run time (hookcli imports torch first).
"""

import sys

from setuptools import Extension, setup

openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []
compile_args = ["-O3", *openmp] if sys.platform != "win32" else ["/O2"]

setup(
    ext_modules=[
        Extension(
            "hookcli.engine._fastreduce",
            ["hookcli/engine/_fastreduce.c"],
            extra_compile_args=compile_args,
            extra_link_args=openmp,
            optional=True,
        )
    ]
)
