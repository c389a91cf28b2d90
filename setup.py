"""Only the optional native page copier lives here; everything else is in pyproject.toml.

``pdxfer.tiers._ntcopy`` streams L2<->L1 page copies past the cache (see its source). It is
optional: without a C compiler the build skips it and ``pdxfer.tiers.copy`` uses memmove.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pdxfer.tiers._ntcopy", ["pdxfer/tiers/_ntcopy.c"],
                             extra_compile_args=["-O2"], optional=True)])
