"""`python cli.py ...` in a checkout: the same program an install runs as `cifar10-towers`.

The commands live in cifar10_towers/cli.py; see `python cli.py --help`.
"""

from cifar10_towers.cli import main

if __name__ == '__main__':
  main()
