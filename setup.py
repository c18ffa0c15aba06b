"""cifar10-towers: the classic TF CIFAR-10 multi-GPU trainer, its TF2 rewrite, and the proof they agree."""

import os

from setuptools import setup


def _version():
  """common/version.py's __version__, read without importing the package."""
  namespace = {}
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'common',
                      'version.py')
  with open(path, encoding='utf-8') as f:
    exec(f.read(), namespace)  # pylint: disable=exec-used
  return namespace['__version__']


setup(
    name='cifar10-towers',
    version=_version(),
    description=('The TensorFlow CIFAR-10 multi-GPU ("tower") trainer on '
                 'tf.compat.v1, its TF2 rewrite, and a cross-check that they '
                 'compute the same averaged gradients.'),
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    license='Apache-2.0',
    python_requires='>=3.10',
    packages=['common', 'legacy', 'modern', 'towerprofile'],
    py_modules=['cli', 'crosscheck', 'convert', 'bench'],
    install_requires=[
        'numpy>=1.24',
        'click>=8.1',
        # tf-slim's git master breaks under Keras 3; the 1.1.0 release works.
        'tf-slim==1.1.0',
        # tf.summary.scalar/histogram/image/graph (TF2) live in tensorboard,
        # which tensorflow no longer installs; 2.16 pairs with the oldest TF.
        'tensorboard>=2.16',
    ],
    extras_require={
        # Pick one: the CPU-only wheel is small; the full wheel carries CUDA support.
        # Capped at the newest release the test suite passed on (2.21).
        'cpu': ['tensorflow-cpu>=2.16,<2.22'],
        'gpu': ['tensorflow[and-cuda]>=2.16,<2.22'],
        # The tests also draw the profile's PNG timeline.
        'test': ['pytest>=7', 'matplotlib>=3.7'],
        # A real image set in CIFAR format, converted from scikit-learn's digits.
        'digits': ['scikit-learn>=1.3'],
        # The PNG timeline of `cli.py profile` (the trace and report need nothing).
        'profile': ['matplotlib>=3.7'],
    },
    entry_points={'console_scripts': ['cifar10-towers=cli:main']},
    classifiers=[
        'Programming Language :: Python :: 3',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
)
