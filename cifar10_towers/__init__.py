"""cifar10-towers: the TF CIFAR-10 multi-GPU trainer, its TF2 rewrite, and the proof they agree.

One package namespace: cifar10_towers.legacy, .modern, .common, .runtime,
.datasets, .towerprofile, and the commands' modules .cli, .crosscheck,
.convert and .bench. An install puts only `cifar10_towers` into site-packages.

In a checkout, legacy/, modern/, common/, runtime/, datasets/ and towerprofile/
sit at the top of the repository, beside this directory, as the project's layout has them;
setup.py installs them inside this package (its package_dir). The lines below
give a checkout the same names: when this directory does not hold them, the
package also looks in the directory above it, so `python cli.py` and the tests
run from a checkout, installed or not, with the imports an install uses.
"""

import os

_HERE = os.path.dirname(os.path.abspath(__file__))

if not os.path.isdir(os.path.join(_HERE, 'legacy')):
  __path__.append(os.path.dirname(_HERE))  # pylint: disable=undefined-variable
