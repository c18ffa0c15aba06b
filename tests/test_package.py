"""The built package: one name in site-packages, a console script that runs, an sdist that stands alone.

Builds the sdist and the wheel once (`python -m build --no-isolation`, with
the setuptools of the test extra, offline) from a copy of the checkout in a
temp dir, so that nothing the build writes (its *.egg-info, build/, dist/)
lands in the checkout; installs the wheel into a fresh venv, and runs it
from outside the checkout.
"""

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

import faults_support as fs

from cifar10_towers.common import version

pytestmark = pytest.mark.slow  # every test runs pip, python -m build or the installed script

# Top-level names the project's modules had before they moved into one
# namespace; none may reach site-packages.
GENERIC_NAMES = ('common', 'runtime', 'datasets', 'cli', 'bench', 'convert', 'crosscheck', 'legacy',
                 'modern', 'towerprofile')


def _run(argv, cwd, env=None, timeout=300):
  return subprocess.run(argv, cwd=cwd, env=env or fs.cli_env(),
                        capture_output=True, text=True, timeout=timeout,
                        check=False)


def _leftovers(directory, names):
  """What builds, runs and virtualenvs leave in a checkout: not copied to build from."""
  return {name for name in names
          if name in ('.git', '__pycache__', '.pytest_cache', 'build', 'dist',
                      'profile_out') or name.endswith('.egg-info')
          or os.path.isfile(os.path.join(directory, name, 'pyvenv.cfg'))}


@pytest.fixture(scope='module')
def dist(tmp_path_factory):
  """(sdist path, wheel path), built from a copy of this checkout."""
  source = tmp_path_factory.mktemp('source') / 'cifar10-towers'
  shutil.copytree(fs.ROOT, source, ignore=_leftovers)
  out = tmp_path_factory.mktemp('dist')
  result = _run([sys.executable, '-m', 'build', '--no-isolation', '--outdir',
                 str(out), str(source)], str(source))
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  sdists = [p for p in os.listdir(out) if p.endswith('.tar.gz')]
  wheels = [p for p in os.listdir(out) if p.endswith('.whl')]
  assert len(sdists) == 1 and len(wheels) == 1, os.listdir(out)
  return str(out / sdists[0]), str(out / wheels[0])


def _site_packages(venv):
  return subprocess.run(
      [os.path.join(venv, 'bin', 'python'), '-c',
       'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
      capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope='module')
def installed(dist, tmp_path_factory):
  """A fresh venv with the wheel installed: (venv, names the wheel added)."""
  venv = str(tmp_path_factory.mktemp('venv'))
  subprocess.run([sys.executable, '-m', 'venv', '--without-pip', venv],
                 check=True)
  site = _site_packages(venv)
  before = set(os.listdir(site))
  result = _run([sys.executable, '-m', 'pip', '--python',
                 os.path.join(venv, 'bin', 'python'), 'install', '--no-deps',
                 '--no-index', '--no-compile', dist[1]], fs.ROOT)
  assert result.returncode == 0, result.stderr[-2000:]
  added = set(os.listdir(site)) - before
  # The dependencies (TensorFlow, click, ...) come from the venv that runs
  # the tests; its own install of this project is not seen, as .pth files
  # are read only in site directories.
  with open(os.path.join(site, 'test_dependencies.pth'), 'w') as f:
    f.write(sysconfig.get_paths()['purelib'] + '\n')
  return venv, added


def test_the_wheel_adds_one_package(installed):
  _, added = installed
  assert {name for name in added if not name.endswith('.dist-info')} == {
      'cifar10_towers'}
  assert not set(GENERIC_NAMES) & added
  assert [name for name in added if name.endswith('.dist-info')] == [
      'cifar10_towers-%s.dist-info' % version.__version__]


def test_the_wheel_holds_the_subpackages(dist):
  with zipfile.ZipFile(dist[1]) as wheel:
    names = wheel.namelist()
  for module in ('cli.py', 'runtime/training.py', 'legacy/train.py',
                 'modern/train.py', 'towerprofile/run.py', 'bench.py',
                 'common/hparams.py', 'datasets/synth.py'):
    assert 'cifar10_towers/' + module in names
  assert not [n for n in names if n.split('/')[0] in GENERIC_NAMES]
  assert [n for n in names if n.endswith('licenses/LICENSE')]


def test_the_console_script_runs_outside_the_checkout(installed, tmp_path):
  venv, _ = installed
  script = os.path.join(venv, 'bin', 'cifar10-towers')
  env = fs.cli_env()
  env.pop('PYTHONPATH', None)
  result = _run([script, '--version'], str(tmp_path), env)
  assert (result.returncode, result.stdout, result.stderr) == (
      0, 'cifar10-towers, version %s\n' % version.__version__, '')

  data_dir = tmp_path / 'data'
  result = _run([script, 'data', 'synth', '--data_dir', str(data_dir),
                 '--train_per_file', '20', '--num_test', '10'],
                str(tmp_path), env)
  assert result.returncode == 0, result.stderr
  batches = data_dir / 'cifar-10-batches-bin'
  assert (batches / 'test_batch.bin').stat().st_size == 10 * 3073
  assert (batches / 'data_batch_5.bin').stat().st_size == 20 * 3073
  # The hints name the program as the user ran it.
  result = _run([script, 'data', 'check', '--data_dir', str(tmp_path)],
                str(tmp_path), env)
  assert result.returncode == 1
  assert '`cifar10-towers data download`' in result.stderr
  assert 'python cli.py' not in result.stdout + result.stderr

  # The package ran from the venv, not from this checkout (found as the import
  # system finds it; running modern.train would import TensorFlow for a path).
  result = _run([os.path.join(venv, 'bin', 'python'), '-c',
                 'import importlib.util; print(importlib.util.find_spec('
                 '"cifar10_towers.modern.train").origin)'], str(tmp_path), env)
  assert result.stdout.strip().startswith(_site_packages(venv)), result


def test_the_sdist_holds_what_the_readme_links_and_the_tests_need(dist):
  with tarfile.open(dist[0]) as sdist:
    names = {name.split('/', 1)[1] for name in sdist.getnames() if '/' in name}
  with open(os.path.join(fs.ROOT, 'README.md'), encoding='utf-8') as f:
    linked = set(re.findall(r'\]\(((?:docs/)?[\w./-]+)(?:#[\w-]*)?\)', f.read()))
  linked = {link for link in linked if not link.startswith('http')}
  assert 'docs/performance.md' in linked  # the pattern finds the links
  assert linked <= names, linked - names
  tests = {name for name in os.listdir(os.path.join(fs.ROOT, 'tests'))
           if name.endswith('.py')}
  assert {'tests/' + name for name in tests} <= names
  assert {'LICENSE', 'pytest.ini', 'cli.py', 'setup.py', 'pyproject.toml',
          'docs/equivalence.md'} <= names


def test_the_sdists_own_tests_run_unpacked(dist, tmp_path):
  with tarfile.open(dist[0]) as sdist:
    sdist.extractall(tmp_path, filter='data')
  (root,) = [p for p in tmp_path.iterdir() if p.is_dir()]
  # Quick ones: the layout (which reads the unpacked sources) and the names
  # the program gives itself; the unpacked copy is what they import.
  result = _run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
                 'tests/test_layout.py', 'tests/test_prog.py'], str(root))
  assert result.returncode == 0, result.stdout[-3000:]
  assert re.search(r'\b\d+ passed\b', result.stdout), result.stdout
  result = _run([sys.executable, 'cli.py', '--version'], str(root))
  assert result.stdout == 'cifar10-towers, version %s\n' % version.__version__
  # Where the import system finds the module (its packages imported, not the
  # module itself: that would import TensorFlow, ~5 s of CPU, for a path).
  result = _run([sys.executable, '-c', 'import importlib.util; print(importlib.util.'
                 'find_spec("cifar10_towers.legacy.train").origin)'], str(root))
  assert result.stdout.strip() == str(root / 'legacy' / 'train.py'), result
