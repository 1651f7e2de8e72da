"""Build of the optional native kernels (everything else is in pyproject.toml).

``deltarefit.codec._native`` is C with an AVX-512 path chosen at run time. It is optional: where it
does not compile, the install goes on and the codec runs its numba kernels, which write the same bytes.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "deltarefit.codec._native",
            ["src/deltarefit/codec/_native.c", "src/deltarefit/codec/_ulp2.c"],
            depends=["src/deltarefit/codec/_ulp2.h", "src/deltarefit/codec/_ulp2_simd.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-overflow"],
            optional=True,
        ),
        # The CLI's SIGBUS handler: a checkpoint truncated by another process while mapped ends the run
        # with one line naming it (``deltarefit.cli``); optional like the kernels.
        Extension("deltarefit._sigbus", ["src/deltarefit/_sigbus.c"], extra_compile_args=["-O2"], optional=True),
    ]
)
