# The package's metadata is in pyproject.toml; this shim, the form setuptools documents, serves tools that still
# run `python setup.py ...`.
from setuptools import setup

setup()
