"""Messages name the program as it was run; `--version` is setup.py's version."""

import os
import re
import stat
import subprocess
import sys

import pytest

import faults_support as fs
from cifar10_towers.common import prog
from cifar10_towers.common import version


def _console_script(directory):
  """A `cifar10-towers` script as pip's console_scripts entry point writes it.

  pip's launcher runs `cifar10_towers.cli:main` with sys.argv[0] = the script's own path;
  this one also puts the checkout first on sys.path, which an install does
  through site-packages.
  """
  path = os.path.join(str(directory), prog.CONSOLE_SCRIPT)
  with open(path, 'w', encoding='utf-8') as f:
    f.write('#!%s\nimport sys\nsys.path.insert(0, %r)\nfrom cifar10_towers.cli import main\n'
            'sys.exit(main())\n' % (sys.executable, fs.ROOT))
  os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)
  return path


def _run(argv, cwd):
  return subprocess.run(argv, cwd=cwd, env=fs.cli_env(), capture_output=True,
                        text=True, timeout=60, check=False)


def test_name_from_argv0():
  assert prog.name('/usr/local/bin/cifar10-towers') == 'cifar10-towers'
  assert prog.name('C:/venv/Scripts/cifar10-towers.exe') == 'cifar10-towers'
  for argv0 in ('cli.py', '/src/cifar10-towers/cli.py', '/venv/bin/pytest', '',
                '-c'):
    assert prog.name(argv0) == 'python cli.py', argv0
  assert prog.command('data check') == 'python cli.py data check'  # under pytest


def test_convert_command_is_exact_and_runs_as_the_cli_parses_it():
  assert prog.convert_command('/tmp/cifar10_train/', 'modern') == (
      'python cli.py convert --from_dir /tmp/cifar10_train/ --to_dir '
      '/tmp/cifar10_train_modern')
  assert prog.convert_command('my runs', 'legacy') == (
      "python cli.py convert --from_dir 'my runs' --to_dir 'my runs_legacy'")
  # Every flag it names is one `convert` has.
  from cifar10_towers import cli  # pylint: disable=import-outside-toplevel
  flags = {opt for p in cli.convert.params for opt in p.opts}
  words = prog.convert_command('/a', 'modern').split()
  assert {w for w in words if w.startswith('--')} <= flags


@pytest.mark.slow
def test_version_is_setup_pys():
  result = _run([sys.executable, 'setup.py', '--version'], fs.ROOT)
  assert result.returncode == 0, result.stderr
  assert result.stdout.strip().splitlines()[-1] == version.__version__
  assert re.fullmatch(r'\d+\.\d+\.\d+', version.__version__)


@pytest.mark.slow
def test_version_and_hint_as_python_cli_py(tmp_path):
  result = _run([sys.executable, fs.CLI, '--version'], fs.ROOT)
  assert (result.returncode, result.stdout, result.stderr) == (
      0, 'cifar10-towers, version %s\n' % version.__version__, '')
  # A hint (no TensorFlow needed): checking a data dir that holds nothing.
  result = _run([sys.executable, fs.CLI, 'data', 'check', '--data_dir',
                 str(tmp_path)], fs.ROOT)
  assert result.returncode == 1
  assert result.stderr.splitlines()[-1] == (
      'Error: 1 problem(s) in %s. Re-download (`python cli.py data download`) '
      'or regenerate (`python cli.py data synth --force`).' % tmp_path)


@pytest.mark.slow
def test_version_and_hint_as_the_console_script(tmp_path):
  script = _console_script(tmp_path)
  result = _run([script, '--version'], str(tmp_path))
  assert (result.returncode, result.stdout, result.stderr) == (
      0, 'cifar10-towers, version %s\n' % version.__version__, '')
  result = _run([script, 'data', 'check', '--data_dir', str(tmp_path)],
                str(tmp_path))
  assert result.returncode == 1
  assert result.stderr.splitlines()[-1] == (
      'Error: 1 problem(s) in %s. Re-download (`cifar10-towers data download`) '
      'or regenerate (`cifar10-towers data synth --force`).' % tmp_path)
  assert 'python cli.py' not in result.stdout + result.stderr
