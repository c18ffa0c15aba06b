"""The README's commands: the Commands section runs top to bottom, and none dirties a clone.

Each shell line of the Commands section's code block is run as written, in
a copy of this checkout's tracked files (a fresh clone's working directory,
committed to a git repository of its own), with the substitutions of
tests/readme_commands.py (its /tmp in a temp dir, smaller flags, no
network, `data download` skipped), and one more:

- `python cli.py` is this checkout's command line, run in this process
  (click's CliRunner, as tests/faults_support.invoke_cli): a process per
  command would import TensorFlow 8 times, ~5 s of CPU each, and the test
  must stay near a minute on 2 cores (`bench` still starts its contenders'
  own processes, forked by tests/fork_server.py: tests/bench_contender.py).
  .ci/run runs the same commands as real `python cli.py`
  processes (`python tests/readme_commands.py`) in the quick start's venv,
  with only the quick start's install; tests/test_prog.py runs real
  processes too. profile's `profile_out/` lands in the copy, where
  .gitignore covers it.

Each command must exit 0 and leave its main output
(readme_commands.main_outputs): `data digits` its files (scikit-learn, the
[digits] extra), `profile` its timeline.png (matplotlib, the [profile]
extra), which the quick start and the test command both install.

Afterwards `git status --porcelain` must be empty in the copy and unchanged
in this checkout (whose commands' subprocesses run there). An unpacked
sdist is no git checkout and has no list of tracked files: there that test
is skipped, saying so. Every output path a README command names is outside
the checkout (an absolute path or a placeholder such as FILE), which the
Commands run cannot see for the commands outside that section.
"""

import functools
import os
import re
import shlex
import shutil
import subprocess
import time

import pytest

import bench_contender
import conftest
import faults_support as fs
import readme_commands as rc

README = rc.README


def test_commands_section_parses():
  commands = rc.read_commands()
  assert len(commands) >= 10
  names = [tuple(c[2:4]) if c[2] == 'data' else (c[2],) for c in commands]
  # Every command of the CLI is shown, data first: the trainers need it.
  for name in [('legacy',), ('modern',), ('eval',), ('crosscheck',),
               ('convert',), ('bench',), ('profile',), ('data', 'synth'),
               ('data', 'check'), ('data', 'digits'), ('data', 'download')]:
    assert name in names, name
  assert names.index(('data', 'synth')) < names.index(('legacy',))


def test_every_command_has_a_main_output():
  """A command the section gains without one fails here, before anything runs."""
  env = rc.environment('/r')
  for words in rc.read_commands():
    if not rc.needs_network(words):
      args = rc.prepared(words, '/r', env['CIFAR10_DATA_DIR'])
      assert rc.main_outputs(args, env, '/w') is not None, words
  assert rc.missing_outputs(['frobnicate'], env, '/w', '', 0) == [
      'no main output is known for `frobnicate`: give it one in '
      'tests/readme_commands.py main_outputs']


def test_a_skipped_or_leftover_output_is_a_failure(tmp_path):
  """`profile` without matplotlib exits 0 and writes no timeline.png: not run."""
  env = rc.environment(str(tmp_path))
  args = ['profile', 'legacy', '--num_gpus', '2']
  out = tmp_path / 'profile_out'
  out.mkdir()
  start = time.time()
  for name in ('trace.json', 'report.json'):
    (out / name).write_text('{}')
  stdout = 'Wrote profile_out/report.json (report).\nWrote profile_out/trace.json (trace).\n'
  png = out / 'timeline.png'
  missing = rc.missing_outputs(args, env, str(tmp_path), stdout, start)
  assert missing[0] == '%s was not written' % png
  assert missing[1].startswith("its stdout has no line matching '^Wrote "), missing
  assert len(missing) == 2, missing
  # One an earlier run left is no output of this one.
  png.write_bytes(b'\x89PNG')
  os.utime(png, (start - 60, start - 60))
  stdout += 'Wrote profile_out/timeline.png (png).\n'
  assert rc.missing_outputs(args, env, str(tmp_path), stdout, start) == [
      '%s is older than the command (a leftover)' % png]
  os.utime(png)
  assert rc.missing_outputs(args, env, str(tmp_path), stdout, start) == []


# Options whose value is a path a command writes to.
OUTPUT_OPTIONS = ('--json', '--plot', '--out', '--dump', '--to_dir', '--train_dir',
                  '--eval_dir', '--data_dir')
# A placeholder in a usage line: DIR, FILE.png, `D]`.
PLACEHOLDER = re.compile(r'^[A-Z]+(\.[a-z]+)?\]?$')


def _git(args, cwd):
  env = {k: v for k, v in os.environ.items() if not k.startswith('GIT_')}
  return subprocess.run(['git'] + args, cwd=cwd, env=env, capture_output=True,
                        text=True, check=False)


def _is_git_checkout():
  """Whether fs.ROOT is the top of a git work tree (an unpacked sdist is not)."""
  if shutil.which('git') is None:
    return False
  top = _git(['rev-parse', '--show-toplevel'], fs.ROOT)
  return (top.returncode == 0
          and os.path.realpath(top.stdout.strip()) == os.path.realpath(fs.ROOT))


def _status(cwd):
  """`git status --porcelain` (every untracked file listed) of the work tree at cwd."""
  result = _git(['status', '--porcelain', '--untracked-files=all'], cwd)
  assert result.returncode == 0, result.stderr
  return result.stdout.splitlines()


def _fresh_clone(work):
  """Copies this checkout's tracked files, as they are now, to work and commits them."""
  listed = _git(['ls-files', '-z'], fs.ROOT)
  assert listed.returncode == 0, listed.stderr
  for name in filter(None, listed.stdout.split('\0')):
    source = os.path.join(fs.ROOT, name)
    if os.path.isfile(source):  # not a file deleted in the working tree
      os.makedirs(os.path.dirname(os.path.join(work, name)), exist_ok=True)
      shutil.copy2(source, os.path.join(work, name))
  for args in (['init', '-q'], ['add', '-A'],
               ['-c', 'user.name=test_readme', '-c', 'user.email=test@localhost',
                '-c', 'commit.gpgsign=false', 'commit', '-q', '--no-verify',
                '-m', 'the checkout\'s tracked files']):
    result = _git(args, work)
    assert result.returncode == 0, (args, result.stderr)
  assert _status(work) == []


@pytest.fixture(scope='module')
def commands_run(tmp_path_factory):
  """Runs the Commands section in a fresh clone; stops at the first failure."""
  base = tmp_path_factory.mktemp('readme')
  root = str(base / 'tmp')  # stands for /tmp
  work = str(base / 'work')
  os.makedirs(root)
  os.makedirs(work)
  checkout = _is_git_checkout()
  if checkout:
    _fresh_clone(work)
  status_before = _status(fs.ROOT) if checkout else None
  env = rc.environment(root)
  commands = rc.read_commands()
  ran, failure = [], None
  from cifar10_towers import bench  # pylint: disable=import-outside-toplevel
  with pytest.MonkeyPatch.context() as monkeypatch:
    monkeypatch.chdir(work)
    monkeypatch.setattr(bench, 'run', functools.partial(
        bench.run, launch=bench_contender.forked_contender()))
    for words in commands:
      if rc.needs_network(words):
        continue
      args = rc.prepared(words, root, env['CIFAR10_DATA_DIR'])
      start = time.time()
      code, out, err, exception = fs.invoke_cli(args, env=env)
      ran.append('%5.1f s  %s' % (time.time() - start, ' '.join(args)))
      print(ran[-1])
      if exception is not None or code != 0:
        failure = (' '.join(words), code, repr(exception), out[-2000:], err[-2000:])
        break
      missing = rc.missing_outputs(args, env, work, out, start)
      if missing:
        failure = (' '.join(words), missing, out[-2000:], err[-2000:])
        break
  return {'commands': commands, 'ran': ran, 'failure': failure, 'work': work,
          'checkout': checkout, 'status_before': status_before}


@pytest.mark.slow
def test_commands_section_runs_in_order(commands_run):
  assert commands_run['failure'] is None, commands_run['failure']
  # All but `data download`.
  assert len(commands_run['ran']) == len(commands_run['commands']) - 1, commands_run['ran']


@pytest.mark.slow
def test_the_commands_leave_a_clone_clean(commands_run):
  """What they write goes where the README says, or where .gitignore covers it."""
  if not commands_run['checkout']:
    pytest.skip('%s is not a git checkout (an unpacked sdist?): no tracked files '
                'to copy, no git status to read' % fs.ROOT)
  assert commands_run['ran']
  assert _status(commands_run['work']) == []
  # Their subprocesses (bench's contenders) run in this checkout.
  assert _status(fs.ROOT) == commands_run['status_before']


def test_every_output_path_in_the_readme_is_outside_the_checkout():
  """A command run as written, from a clone, writes nothing into it (docs/ included)."""
  text = open(README, encoding='utf-8').read()
  blocks = re.findall(r'^```[a-z]*\n(.*?)^```$', text, re.M | re.S)
  checked = []
  for block in blocks:
    for line in block.replace('\\\n', ' ').splitlines():
      if 'cli.py' not in line and 'cifar10-towers ' not in line:
        continue
      words = shlex.split(line, comments=True)
      for option, value in zip([w.lstrip('[') for w in words], words[1:]):
        if option in OUTPUT_OPTIONS:
          checked.append(value)
          assert os.path.isabs(value) or PLACEHOLDER.match(value), (option, value, line)
  assert '/tmp/bench.json' in checked and '/tmp/performance.png' in checked


def test_the_readme_says_how_many_tests_each_test_command_runs():
  """Its test command runs the whole suite; the quick tier's, the tests not marked slow."""
  if not conftest.COUNTS:
    pytest.skip('this run did not collect the whole suite (tests/): no counts to compare')
  text = open(README, encoding='utf-8').read()
  block = re.search(r'<!-- quick-test-command -->\n```\n(.*)\n```', text)
  assert block and block[1].endswith(" python -m pytest -q -m 'not slow'"), block
  stated = {'all': re.findall(r'all (\d+) tests', text),
            'quick': re.findall(r'the (\d+) tests that neither', text)}
  assert stated == {name: [str(count)] for name, count in conftest.COUNTS.items()}
