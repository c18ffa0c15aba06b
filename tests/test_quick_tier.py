"""The quick tier's guard (tests/conftest.py): what it notes, and its verdict on a marker."""

import importlib
import multiprocessing
import os
import subprocess
import sys

import pytest

import conftest
import faults_support as fs


def test_a_marker_must_say_what_its_test_did():
  reason = conftest.costly_reason
  assert reason(False, [], {}) is None
  assert reason(True, ['calls m.train()'], {}) is None
  assert reason(True, [], {'trained': 'calls m.train()'}) is None
  assert reason(False, ['starts a process (true)', 'calls m.train()'], {}).startswith(
      'not marked slow, but it starts a process (true): mark it @pytest.mark.slow')
  assert reason(False, [], {'trained': 'calls m.train()'}).startswith(
      "not marked slow, but it calls m.train(), through its fixture 'trained': mark it")
  assert reason(True, [], {}).startswith(
      "marked slow, but it neither trains (a trainer's train(), crosscheck.run, profile) "
      'nor starts a process: drop the marker')


@pytest.mark.slow
def test_every_way_to_start_a_process_is_noted():
  start = len(conftest._COSTLY)  # pylint: disable=protected-access
  subprocess.run(['true'], check=True)
  assert os.system('true') == 0
  os.waitpid(os.posix_spawnp('true', ['true'], os.environ), 0)
  pid = os.fork()
  if pid == 0:
    os._exit(0)  # pylint: disable=protected-access
  os.waitpid(pid, 0)
  child = multiprocessing.get_context('spawn').Process(target=int)
  child.start()
  child.join()
  assert child.exitcode == 0
  spawned = fs.Spawned([os.devnull], fs.cli_env())  # a child of tests/fork_server.py
  spawned.communicate(timeout=60)
  assert spawned.returncode == 0
  noted = conftest._COSTLY[start:]  # pylint: disable=protected-access
  assert noted[:4] == ['starts a process (true)'] * 3 + ['forks (os.fork)'], noted
  # multiprocessing's child (and its resource tracker, the first time).
  child_line = 'starts a process (%s -B -c from multiprocessing.spawn import spawn_main; ' % (
      sys.executable)
  assert any(n.startswith(child_line) for n in noted), noted
  # (The fork server's own start too, the first time a test forks from it.)
  assert noted[-1] == 'starts a process ((forked) %s)' % os.devnull, noted


@pytest.mark.slow
@pytest.mark.parametrize('module,name', [('cifar10_towers.legacy.train', 'train'),
                                         ('cifar10_towers.modern.train', 'train'),
                                         ('cifar10_towers.crosscheck', 'run'),
                                         ('cifar10_towers.towerprofile.run', 'profile')])
def test_a_call_of_a_trainers_train_or_crosscheck_run_is_noted(module, name):
  func = getattr(importlib.import_module(module), name)
  start = len(conftest._COSTLY)  # pylint: disable=protected-access
  with pytest.raises(TypeError):  # no arguments: noted, then refused before it runs
    func()
  assert conftest._COSTLY[start:] == ['calls %s.%s()' % (module, name)]  # pylint: disable=protected-access
