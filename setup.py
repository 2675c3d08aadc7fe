"""The one compiled part: an optional streaming-store copy (rlferry works without it)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rlferry.wire._fastcopy",
            ["src/rlferry/wire/_fastcopy.c"],
            extra_compile_args=["-O2"],
            optional=True,  # no compiler: installed without it, copies use libc memmove
        )
    ]
)
