"""The README's commands: the Commands section runs top to bottom, and none dirties a clone.

Each shell line of the Commands section's code block is run as written, in
a copy of this checkout's tracked files (a fresh clone's working directory,
committed to a git repository of its own), with these substitutions (and
nothing else):

- `python cli.py` is this checkout's command line, run in this process
  (click's CliRunner, as tests/faults_support.invoke_cli): a process per
  command would import TensorFlow 8 times, ~5 s of CPU each, and the test
  must stay near a minute on 2 cores (`bench` still starts its contenders'
  own processes). tests/test_prog.py runs real `python cli.py` processes;
- every `/tmp/...` path becomes the same path under the test's temp dir, and
  the defaults the section relies on are redirected there too, through the
  options' own environment variables: CIFAR10_DATA_DIR (default data dir),
  CIFAR10_TRAIN_DIR (default train dir), CIFAR10_EVAL_DIR (default eval
  dir); profile's `profile_out/` lands in the copy, where .gitignore
  covers it;
- flags in SMALLER are appended (click keeps an option's last value), so a
  trainer takes 2 steps of batch 8 instead of 1,000,000 of 128 and the whole
  section runs in about a minute; the commands' meaning is unchanged;
- CIFAR10_DATA_URL points at a closed port, so nothing touches the network.

`data download` fetches 170 MB from the network, so it is the one command
skipped (tests/test_download.py covers it with a local server). Everything
else - including `data digits`, which needs the [digits] extra
(scikit-learn), as the README's test command installs - must exit 0.

Afterwards `git status --porcelain` must be empty in the copy and unchanged
in this checkout (whose commands' subprocesses run there). An unpacked
sdist is no git checkout and has no list of tracked files: there that test
is skipped, saying so. Every output path a README command names is outside
the checkout (an absolute path or a placeholder such as FILE), which the
Commands run cannot see for the commands outside that section.
"""

import os
import re
import shlex
import shutil
import subprocess
import time

import pytest

import faults_support as fs

README = os.path.join(fs.ROOT, 'README.md')
NEEDS_NETWORK = {('data', 'download')}
SMALL_DATA = ['--train_per_file', '100', '--num_test', '100']
SMALL_TRAIN = ['--max_steps', '2', '--batch_size', '8', '--log_every', '1']
# Appended to a command whose words start with the key.
SMALLER = {
    ('data', 'synth'): SMALL_DATA,
    ('legacy',): SMALL_TRAIN,
    ('modern',): SMALL_TRAIN,
    ('eval',): ['--batch_size', '50'],
    ('crosscheck',): ['--batch_size', '4', '--steps', '1'],
    # One trainer: each more one is two more processes importing TensorFlow.
    ('bench',): ['--impl', 'modern', '--num_gpus', '1', '--batch_size', '8',
                 '--rounds', '1', '--warmup_rounds', '0', '--window_steps', '1',
                 '--matmul_size', '64', '--data_dir', '{data_dir}'],
    ('profile',): ['--batch_size', '8', '--steps', '1'],
}


def commands_section(text):
  """The shell lines of the first code block under '## Commands'."""
  section = text.split('\n## Commands\n', 1)[1].split('\n## ', 1)[0]
  block = re.search(r'^```\n(.*?)^```$', section, re.M | re.S).group(1)
  return [shlex.split(line, comments=True) for line in block.splitlines()
          if line.strip()]


def _prepared(words, root, data_dir):
  assert words[:2] == ['python', 'cli.py'], words
  args = [root + w[len('/tmp'):] if w.startswith('/tmp/') else w for w in words[2:]]
  for prefix, extra in SMALLER.items():
    if tuple(args[:len(prefix)]) == prefix:
      args += [e.format(data_dir=data_dir) for e in extra]
  return args


def test_commands_section_parses():
  commands = commands_section(open(README, encoding='utf-8').read())
  assert len(commands) >= 10
  names = [tuple(c[2:4]) if c[2] == 'data' else (c[2],) for c in commands]
  # Every command of the CLI is shown, data first: the trainers need it.
  for name in [('legacy',), ('modern',), ('eval',), ('crosscheck',),
               ('convert',), ('bench',), ('profile',), ('data', 'synth'),
               ('data', 'check'), ('data', 'digits'), ('data', 'download')]:
    assert name in names, name
  assert names.index(('data', 'synth')) < names.index(('legacy',))


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
  data_dir = os.path.join(root, 'cifar10_data')
  env = {'CIFAR10_DATA_DIR': data_dir,
         'CIFAR10_TRAIN_DIR': os.path.join(root, 'cifar10_train'),
         'CIFAR10_EVAL_DIR': os.path.join(root, 'cifar10_eval'),
         'CIFAR10_DATA_URL': fs.closed_port_url()}
  commands = commands_section(open(README, encoding='utf-8').read())
  ran, failure = [], None
  with pytest.MonkeyPatch.context() as monkeypatch:
    monkeypatch.chdir(work)
    for words in commands:
      if tuple(words[2:4]) in NEEDS_NETWORK:
        continue
      args = _prepared(words, root, data_dir)
      start = time.time()
      code, out, err, exception = fs.invoke_cli(args, env=env)
      ran.append('%5.1f s  %s' % (time.time() - start, ' '.join(args)))
      print(ran[-1])
      if exception is not None or code != 0:
        failure = (' '.join(words), code, repr(exception), out[-2000:], err[-2000:])
        break
  return {'commands': commands, 'ran': ran, 'failure': failure, 'work': work,
          'checkout': checkout, 'status_before': status_before}


def test_commands_section_runs_in_order(commands_run):
  assert commands_run['failure'] is None, commands_run['failure']
  # All but `data download`.
  assert len(commands_run['ran']) == len(commands_run['commands']) - 1, commands_run['ran']


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
