"""The process around a command: a closed stderr, a stop signal after the command ended.

Real processes (`python cli.py`): the file descriptors and the interpreter's
teardown are the point. No TensorFlow: `data check` and `data synth`.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import faults_support as fs

pytestmark = pytest.mark.slow  # every test runs `python cli.py` as a process


@pytest.mark.parametrize('good', [True, False], ids=['valid data', 'no data'])
def test_a_closed_stderr_runs_the_command_as_usual(good, synth_data_dir, tmp_path):
  """`2>&-` (a daemon, `cmd 2>&- &`): stdout and the exit status as usual, stderr dropped.

  With fd 2 closed Python has no sys.stderr: the diagnostics must not go to stdout.
  """
  data_dir = synth_data_dir if good else str(tmp_path / 'none')
  result = subprocess.run(
      [sys.executable, fs.CLI, 'data', 'check', '--data_dir', data_dir], cwd=fs.ROOT,
      env=fs.cli_env(), stdout=subprocess.PIPE, text=True, timeout=60, check=False,
      preexec_fn=lambda: os.close(2))
  assert result.returncode == (0 if good else 1)
  lines = result.stdout.splitlines()
  if good:
    assert lines[-1] == f'{data_dir}: all 6 files are valid.', lines
  else:
    assert lines == [], lines  # the problem and the Error line were stderr's


# A child that runs the CLI and sends itself SIGTERM after the command ended:
# while the atexit hooks run, or while the interpreter is torn down (where
# TensorFlow's 1-2 s go, with Python's signal handlers already given back).
_SIGNAL_AFTER = textwrap.dedent('''
    import atexit, os, signal, sys, time
    when, sys.argv = sys.argv[1], ['cli.py'] + sys.argv[2:]
    from cifar10_towers import cli

    def term(kill=os.kill, pid=os.getpid(), sleep=time.sleep, write=os.write):
      write(1, b'signalled\\n')
      kill(pid, signal.SIGTERM)
      sleep(2)

    class Teardown:
      def __del__(self):
        term()

    if when == 'atexit':
      atexit.register(term)
    else:
      held = Teardown()
    cli.main()
''')


@pytest.mark.parametrize('when', ['atexit', 'teardown'])
@pytest.mark.parametrize('good', [True, False], ids=['finished', 'failed'])
def test_a_stop_signal_after_the_command_keeps_its_status(when, good, synth_data_dir, tmp_path):
  """Its result kept (0) or its failure said (1): a SIGTERM then ends the process at once
  with that status, not 143, so `convert && modern` goes on."""
  data_dir = synth_data_dir if good else str(tmp_path / 'none')
  result = subprocess.run(
      [sys.executable, '-c', _SIGNAL_AFTER, when, 'data', 'check', '--data_dir', data_dir],
      cwd=fs.ROOT, env=fs.cli_env(), capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == (0 if good else 1), result.stderr
  if when == 'atexit':  # the hooks still run (TensorFlow's clean-up)
    assert result.stdout.splitlines()[-1] == 'signalled', result.stdout


# A child whose command is stopped by SIGTERM (sent as `data synth` begins to
# write), with an atexit hook that says it ran.
_STOPPED = textwrap.dedent('''
    import atexit, os, signal, sys
    sys.argv = ['cli.py'] + sys.argv[1:]
    from cifar10_towers import cli
    from cifar10_towers.datasets import synth
    atexit.register(os.write, 1, b'atexit hooks ran\\n')
    synth.generate = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGTERM)
    cli.main()
''')


def test_a_stopped_command_still_runs_the_atexit_hooks(tmp_path):
  """Stopped: its line and 143, and the atexit hooks run as after any ending (TensorFlow's
  removes its autograph temp files: a stopped modern run left 38 in $TMPDIR before)."""
  result = subprocess.run(
      [sys.executable, '-c', _STOPPED, 'data', 'synth', '--data_dir', str(tmp_path / 'data')],
      cwd=fs.ROOT, env=fs.cli_env(), capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 143, result.stderr
  assert fs.ours(result.stderr)[-1] == ('Stopped by SIGTERM; `data synth` did not finish, and '
                                        'left nothing half-written.'), result.stderr
  assert result.stdout.splitlines()[-1] == 'atexit hooks ran', result.stdout
