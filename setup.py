"""The optional C extension, which pyproject.toml can only declare in an experimental table.

The chunk relay (pd/native_relay.py) is compiled at install; where it cannot be (no C compiler, no
Python headers) the install goes on, and the gateway relays in Python, saying so at start.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("pdserve.pd._chunk_relay", ["pdserve/pd/_chunk_relay.c"], extra_compile_args=["-O2"],
                             optional=True)])
