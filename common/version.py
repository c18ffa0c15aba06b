"""The version of cifar10-towers, written once: setup.py reads it, `--version` prints it.

No imports: setup.py executes this file without importing the package.
"""

__version__ = '0.1.0'
