"""Shared fixtures: logical CPU devices for the towers, and small generated data."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

# CIFAR10_TOWERS_TF_NOISE=1 (CI sets it): this process and every Python
# process the suite starts write TensorFlow's known noise (tests/tf_noise).
if os.environ.get('CIFAR10_TOWERS_TF_NOISE') == '1':
  _NOISE = os.path.join(ROOT, 'tests', 'tf_noise')
  os.environ['PYTHONPATH'] = os.pathsep.join(
      [_NOISE] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p])
  import importlib.util  # pylint: disable=wrong-import-position
  _spec = importlib.util.spec_from_file_location(
      'tf_noise', os.path.join(_NOISE, 'sitecustomize.py'))
  _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

NUM_LOGICAL_DEVICES = 4  # enough for every multi-tower test


@pytest.fixture(scope='session', autouse=True)
def cli_logging():
  """The library's log lines reach stdout and stderr as under the CLI (capsys reads them)."""
  from cifar10_towers import cli
  cli._configure_logging()  # pylint: disable=protected-access


@pytest.fixture(scope='session', autouse=True)
def device_plan(cli_logging):  # pylint: disable=redefined-outer-name,unused-argument
  """Splits the CPU into 4 logical devices before any test starts TensorFlow."""
  from cifar10_towers.common import devices
  return devices.plan_devices(NUM_LOGICAL_DEVICES)


@pytest.fixture(scope='session', autouse=True)
def default_eval_dir(tmp_path_factory):
  """`eval` without --eval_dir writes here, not to the machine's /tmp/cifar10_eval."""
  path = str(tmp_path_factory.mktemp('default_eval_dir'))
  before = os.environ.get('CIFAR10_EVAL_DIR')
  os.environ['CIFAR10_EVAL_DIR'] = path
  yield path
  if before is None:
    os.environ.pop('CIFAR10_EVAL_DIR', None)
  else:
    os.environ['CIFAR10_EVAL_DIR'] = before


@pytest.fixture(scope='session')
def synth_data_dir(tmp_path_factory):
  """A small generated CIFAR-format data dir (shared, read-only for tests).

  Unmarked (no GENERATED.json): it stands in for CIFAR-10, so training and
  eval on it print nothing about generated data, and the tests pin their
  stderr as on the real set. tests/test_generated.py covers marked data.
  """
  from cifar10_towers.datasets import synth
  data_dir = str(tmp_path_factory.mktemp('synth_data'))
  synth.generate(data_dir, train_per_file=200, num_test=300, seed=0, mark=False)
  return data_dir
