"""Shared fixtures: logical CPU devices for the towers, and small generated data;
and the quick tier's guard: a test is marked `slow` exactly when it trains or
starts a process (see the end of this file).
"""

import functools
import importlib.abc
import os
import platform
import subprocess
import sys

import _posixsubprocess
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


def _stop_signals_not_ignored():
  """A test process started in the background by a script (`pytest ... &`) or a
  scheduler inherits SIGINT and SIGQUIT ignored, as nohup leaves SIGHUP, and the
  trainers rightly leave an ignored signal ignored (docs/ending.md). The suite's
  stop-signal tests send them, to this process and to the processes it starts
  (which inherit an ignored signal): they begin from the signals' defaults."""
  import signal  # pylint: disable=import-outside-toplevel
  from cifar10_towers.runtime import training  # pylint: disable=import-outside-toplevel
  for sig in training.STOP_SIGNALS:
    if signal.getsignal(sig) == signal.SIG_IGN:
      signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


_stop_signals_not_ignored()


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


# --- The quick tier: `python -m pytest -m 'not slow'` -------------------------
# It runs every test except those that call a trainer's train() or
# crosscheck.run (or profile's training run), or start a process (a fork, an
# exec, a child of tests/fork_server.py): those, and only those, are marked
# `slow`. Every run of a test checks its marker against what it did, itself or
# through a fixture it uses: an unmarked test that did one of these, or a
# marked one that did none, fails with the reason. So neither the quick tier
# nor the marker drifts as tests change, and CI, which runs everything,
# catches a wrong marker.

_COSTLY = []  # what this process did that the quick tier leaves out, in order
_COSTLY_FIXTURES = {}  # fixturedef -> the first such thing its setup did
_START = pytest.StashKey[int]()
_CALL_PASSED = pytest.StashKey[bool]()


def _noting(func, describe):
  """func, noting describe(*args) in _COSTLY at each call."""

  @functools.wraps(func)
  def noted(*args, **kwargs):
    _COSTLY.append(describe(*args))
    return func(*args, **kwargs)
  return noted


def _starts(argv):
  command = ' '.join(os.fsdecode(a) for a in argv)
  return 'starts a process (%s)' % (command if len(command) < 100 else command[:96] + ' ...')


# platform.processor() (TensorFlow's import asks) runs `uname -p` once per
# process and keeps the answer: asked here first, that process is no test's.
platform.processor()

# Every way Python starts a process: subprocess (its own name for
# _posixsubprocess.fork_exec, or os.posix_spawn), multiprocessing's spawn
# (fork_exec), os.fork (multiprocessing's fork, pty), os.system.
_posixsubprocess.fork_exec = subprocess._fork_exec = _noting(  # pylint: disable=protected-access
    _posixsubprocess.fork_exec, lambda argv, *_: _starts(argv))
for _name in ('posix_spawn', 'posix_spawnp'):
  setattr(os, _name, _noting(getattr(os, _name), lambda path, argv, *_: _starts(argv)))
for _name in ('fork', 'forkpty'):
  setattr(os, _name, _noting(getattr(os, _name), lambda *_, n=_name: 'forks (os.%s)' % n))
os.system = _noting(os.system, lambda command: _starts([command]))

# A child of the fork server starts in that server, not here; and
# trained_dir trains once, then hands its cached dir to every later caller.
import faults_support  # pylint: disable=wrong-import-position
faults_support._ForkServer.spawn = _noting(  # pylint: disable=protected-access
    faults_support._ForkServer.spawn,  # pylint: disable=protected-access
    lambda server, argv, *_: _starts(['(forked)'] + list(argv)))
faults_support.trained_dir = _noting(
    faults_support.trained_dir,
    lambda impl, *_: 'calls %s train() (faults_support.trained_dir)' % impl)

# The trainers' train(), crosscheck.run, and profile's run, which trains
# traced steps through the trainers' own graphs without their train().
_TRAINING = {'cifar10_towers.legacy.train': 'train', 'cifar10_towers.modern.train': 'train',
             'cifar10_towers.crosscheck': 'run', 'cifar10_towers.towerprofile.run': 'profile'}


class _TrainingFinder(importlib.abc.MetaPathFinder):
  """Notes each call of _TRAINING's functions, wrapped as their modules load."""

  def find_spec(self, fullname, path, target=None):
    if fullname not in _TRAINING:
      return None
    for finder in sys.meta_path:
      if finder is not self and hasattr(finder, 'find_spec'):
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
          break
    else:
      return None
    exec_module = spec.loader.exec_module

    def exec_and_wrap(module):
      exec_module(module)
      name = _TRAINING[fullname]
      setattr(module, name, _noting(getattr(module, name),
                                    lambda *_: 'calls %s.%s()' % (fullname, name)))
    spec.loader.exec_module = exec_and_wrap
    return spec


assert not set(_TRAINING) & set(sys.modules), 'loaded before conftest: not noted'
sys.meta_path.insert(0, _TrainingFinder())


def costly_reason(marked, costly, fixtures):
  """Why a passed test's `slow` marker is wrong, or None.

  Args:
    marked: whether the test is marked slow.
    costly: what the test did that the quick tier leaves out (its own calls,
      and its fixtures' setups during it).
    fixtures: {fixture name: what its setup did}, for the fixtures it uses
      whose setup, during this test or an earlier one, did such a thing.
  """
  if marked and not costly and not fixtures:
    return ('marked slow, but it neither trains (a trainer\'s train(), crosscheck.run, '
            'profile) nor starts a process: drop the marker, so that the quick tier runs it')
  if not marked and (costly or fixtures):
    why = costly[0] if costly else '%s, through its fixture %r' % (
        next(iter(fixtures.values())), next(iter(fixtures)))
    return ('not marked slow, but it %s: mark it @pytest.mark.slow (the quick tier, '
            "pytest -m 'not slow', runs no test that trains or starts a process)" % why)
  return None


COUNTS = {}  # 'all' and 'quick': the tests of the whole suite and of the quick tier,
# when this run collected the whole suite


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Counts the whole suite's tests before -m or -k deselect any (the README states both)."""
  if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
    COUNTS['all'] = len(items)
    COUNTS['quick'] = sum(item.get_closest_marker('slow') is None for item in items)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef):
  start = len(_COSTLY)
  yield
  if len(_COSTLY) > start:
    _COSTLY_FIXTURES.setdefault(fixturedef, _COSTLY[start])


def _costly_fixtures(item):
  """{name: what its setup did} of the costly fixtures the test used, requested
  by name or with request.getfixturevalue."""
  used = item._request._fixture_defs  # pylint: disable=protected-access
  return {name: _COSTLY_FIXTURES[d] for name, d in used.items() if d in _COSTLY_FIXTURES}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  item.stash[_START] = len(_COSTLY)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # pylint: disable=unused-argument
  """Fails the teardown of a passed test whose `slow` marker is wrong."""
  report = (yield).get_result()
  if report.when == 'call':
    item.stash[_CALL_PASSED] = report.passed
  if report.when != 'teardown' or not report.passed or not item.stash.get(_CALL_PASSED, False):
    return
  fixtures = _costly_fixtures(item)
  reason = costly_reason(item.get_closest_marker('slow') is not None,
                         _COSTLY[item.stash[_START]:], fixtures)
  if reason is not None:
    report.outcome = 'failed'
    report.longrepr = '%s: %s' % (item.nodeid, reason)
