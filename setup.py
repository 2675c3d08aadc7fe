"""The compiled parts, both optional (rlferry works without them): a streaming-store copy
and the CPU diff and apply of delta pushes."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rlferry.wire._fastcopy",
            ["src/rlferry/wire/_fastcopy.c"],
            extra_compile_args=["-O2"],
            optional=True,  # no compiler: installed without it, copies use libc memmove
        ),
        Extension(
            "rlferry.weights.delta._fastdiff",
            ["src/rlferry/weights/delta/_fastdiff.c"],
            extra_compile_args=["-O2"],
            optional=True,  # no compiler: installed without it, deltas use torch ops
        ),
    ]
)
