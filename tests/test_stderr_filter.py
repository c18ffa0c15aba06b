"""TensorFlow's known stderr noise never reaches the user; every other line does, in order."""

import os
import subprocess
import sys
import textwrap

import pytest

import faults_support as fs
from cifar10_towers.runtime import stderr_filter

NOISE_DIR = os.path.join(fs.ROOT, 'tests', 'tf_noise')
sys.path.insert(0, NOISE_DIR)
import sitecustomize as tf_noise  # pylint: disable=wrong-import-position,wrong-import-order


def _known(lines):
  return [l for l in lines if stderr_filter.KNOWN.fullmatch(l)]


@pytest.mark.slow
def test_known_lines_dropped_the_rest_passed_in_order_and_the_ending_last():
  """No TensorFlow here: fd 2 written as its C++ would, a partial line, then the ending line."""
  code = textwrap.dedent('''
      import os, sys
      sys.path.insert(0, %r)
      import sitecustomize as tf_noise
      from cifar10_towers.runtime import ending, stderr_filter
      stderr_filter.install()
      os.write(2, b'first\\n' + tf_noise.noise().encode())
      print('from python', file=sys.stderr, flush=True)
      os.write(2, tf_noise.noise().encode() + b'no newline')
      ending.exit_now(3, 'The ending line.')
  ''' % NOISE_DIR)
  result = subprocess.run([sys.executable, '-c', code], cwd=fs.ROOT, env=fs.cli_env(),
                          capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 3, result.stderr
  lines = result.stderr.splitlines()
  unknown = [l for l in lines if tf_noise.UNKNOWN_MARK in l]
  assert len(unknown) == 2, lines
  assert [l for l in lines if l not in unknown] == [
      'first', 'from python', 'no newline', 'The ending line.'], lines
  assert _known(tf_noise.noise().splitlines()) and not _known(lines), lines


@pytest.mark.slow
@pytest.mark.parametrize('noisy', [True, False], ids=['noise switched on', 'as it comes'])
def test_a_command_that_runs_tensorflow_shows_the_unknown_line_not_the_known(
    noisy, synth_data_dir, tmp_path):
  """`eval` imports TensorFlow, then fails: its error line, the unknown line, no known one."""
  path = os.environ.get('PYTHONPATH')
  env = {'CIFAR10_TOWERS_TF_NOISE': '1' if noisy else '0',
         'PYTHONPATH': NOISE_DIR + (os.pathsep + path if path else '')}
  missing = str(tmp_path / 'none')
  result = fs.run_cli(['eval', '--run_once', '--checkpoint_dir', missing,
                       '--data_dir', synth_data_dir], env=env)
  assert result.returncode == 1, result.stderr
  lines = result.stderr.splitlines()
  assert lines[-1].startswith('Error: no checkpoint in %s.' % missing), lines
  assert not _known(lines), lines
  assert any(tf_noise.UNKNOWN_MARK in l for l in lines) == noisy, lines
