"""cifar10-towers' build: everything is declared in pyproject.toml.

`pip install -e '.[cpu,test]'` (or `python -m build`) reads pyproject.toml;
this file remains for tools that still run `setup.py`.
"""

from setuptools import setup

setup()
