"""`python crosscheck_child.py OUT DEVICES ARGS_JSON`: a test's `crosscheck` runs, in a process.

tests/faults_support.crosscheck_in_background forks this (tests/fork_server.py)
so that a module's slowest cross-checks run beside its other tests, on the
core the single-threaded test process leaves idle. ARGS_JSON is a list of
argument lists, each run as faults_support.crosscheck_cli runs it in the
test process (click's CliRunner, on DEVICES logical CPU devices, as many as
the test process split the CPU into), or of dicts, each run as
faults_support.crosscheck_run runs its arguments; OUT receives the pickled list of
(exit code, output, what crosscheck.run returned, traceback text or None).
"""

import json
import os
import pickle
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# pylint: disable=wrong-import-position
import pytest

from cifar10_towers import cli
from cifar10_towers.common import devices

import faults_support as fs

cli._configure_logging()  # pylint: disable=protected-access
devices.plan_devices(int(sys.argv[2]))  # as the test process (conftest.device_plan)
_results = []
for _args in json.loads(sys.argv[3]):
  try:
    if isinstance(_args, dict):  # crosscheck.run's arguments: fs.crosscheck_run
      _results.append(fs.crosscheck_run(**_args) + (None,))
      continue
    with pytest.MonkeyPatch.context() as _monkeypatch:
      _result, _run = fs.crosscheck_cli(_monkeypatch, _args)
    _error = (None if _result.exception is None or isinstance(_result.exception, SystemExit)
              else ''.join(traceback.format_exception(*_result.exc_info)))
    _results.append((_result.exit_code, _result.output, _run, _error))
  except Exception:  # pylint: disable=broad-except
    _results.append((None, None, None, traceback.format_exc()))
with open(sys.argv[1], 'wb') as _f:
  pickle.dump(_results, _f)
