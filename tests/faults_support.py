"""What the fault tests (tests/test_faults_*.py) share: running the CLI, snapshots, damage.

The CLI runs either as a real subprocess (`python cli.py ...`, stdout and
stderr kept apart, so "no traceback" is checked on what a user would see) or
in-process with click's CliRunner, which skips the 5 s TensorFlow import and
reuses the test session's 4 logical CPU devices.
"""

import atexit
import ctypes
import hashlib
import json
import logging
import os
import pickle
import re
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(ROOT, 'cli.py')
TRAINERS = ('legacy', 'modern')
# Small and fast: every run of a trainer in these tests uses these.
FAST_FLAGS = ('--batch_size', '8', '--log_every', '1', '--summary_every', '1000')


class Logged(logging.Handler):
  """A context: the lines the library logs inside it, as the CLI splits them.

  `out`: below WARNING (stdout under the CLI); `err`: the others (stderr).
  `then(line)`, if given, runs after each line (e.g. to send a signal).
  """

  def __init__(self, then=None):
    super().__init__()
    self.out, self.err, self._then = [], [], then

  def emit(self, record):
    line = record.getMessage()
    (self.out if record.levelno < logging.WARNING else self.err).append(line)
    if self._then is not None:
      self._then(line)

  def __enter__(self):
    logging.getLogger('cifar10_towers').addHandler(self)
    return self

  def __exit__(self, *exc):
    logging.getLogger('cifar10_towers').removeHandler(self)
    return False


def cli_env(extra=None):
  env = dict(os.environ)
  env.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  env['PYTHONUNBUFFERED'] = '1'
  env.update(extra or {})
  return env


# A line TensorFlow's C++ (absl) logging writes to stderr: some CPUs print a
# few at start-up that no setting silences (runtime.stderr_filter drops the
# known ones), and CIFAR10_TOWERS_TF_NOISE=1 adds an unknown one. Tests assert
# on the lines we print, never on the absence of TensorFlow's.
TF_LOG_LINE = re.compile(r'[IWEF]\d{4} [\d:.]+\s+\d+ \S+:\d+\] |'
                         r'WARNING: All log messages before absl::InitializeLog')


def ours(text):
  """The lines of `text` (a stderr) that are not TensorFlow's C++ log lines."""
  return [line for line in text.splitlines() if not TF_LOG_LINE.match(line)]


def run_cli(args, env=None, timeout=180, forked=False):
  """`python cli.py ARGS` as a user runs it; forked: by the fork server (spawn_cli).

  Returns:
    subprocess.CompletedProcess with text stdout and stderr.
  """
  if forked:
    proc = spawn_cli(args, env)
    out, err = proc.communicate(timeout)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
  return subprocess.run([sys.executable, CLI] + [str(a) for a in args],
                        cwd=ROOT, env=cli_env(env), capture_output=True,
                        text=True, timeout=timeout, check=False)


# --- processes forked from one that imported TensorFlow (tests/fork_server.py) --


class _ForkServer:
  """tests/fork_server.py, started at the first spawn, ended with the session."""

  def __init__(self):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    self.proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, 'tests', 'fork_server.py'),
         str(theirs.fileno())], cwd=ROOT, env=cli_env(), pass_fds=[theirs.fileno()],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    theirs.close()
    self.sock = ours
    assert self.sock.recv(64) == b'ready', 'the fork server did not start'
    self.lock = threading.Lock()  # one request at a time
    self.pids = queue.Queue()
    self.statuses = {}  # pid -> waitpid status
    self.ended = threading.Condition()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    while True:
      message = self.sock.recv(1 << 16)
      if not message:
        return
      reply = json.loads(message)
      if 'pid' in reply:
        self.pids.put(reply['pid'])
      else:
        with self.ended:
          self.statuses[reply['exit']] = reply['status']
          self.ended.notify_all()

  def spawn(self, argv, env, cwd, new_session, fds):
    request = json.dumps({'argv': argv, 'env': env, 'cwd': cwd,
                          'new_session': new_session}).encode()
    with self.lock:
      socket.send_fds(self.sock, [request], fds)
      return self.pids.get(timeout=60)

  def close(self):
    self.sock.shutdown(socket.SHUT_RDWR)  # the server's end of the session
    try:
      self.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      self.proc.kill()
      self.proc.wait()
    self.sock.close()


_FORK_SERVER = []
_FORK_SERVER_START = threading.Lock()  # one server, whichever thread spawns first


@atexit.register
def _close_fork_server():
  for server in _FORK_SERVER:
    server.close()


class Spawned:
  """`python ARGV` forked by the fork server: a subprocess.Popen's face
  (pid, stdout, stderr, returncode, poll, wait, send_signal, kill, communicate)."""

  def __init__(self, argv, env, cwd=ROOT, new_session=False, stdout=None, stdin=None):
    """stdout: a file descriptor for the process's stdout (as a shell's `| head`);
    None: a pipe read as self.stdout. stdin: a file descriptor for its stdin;
    None: a pipe at its end."""
    with _FORK_SERVER_START:
      if not _FORK_SERVER:
        _FORK_SERVER.append(_ForkServer())
    self._server = _FORK_SERVER[0]
    pipes = [os.pipe() for _ in range(3)]
    if stdin is not None:
      os.close(pipes[0][0])
      os.close(pipes[0][1])
      pipes[0] = (os.dup(stdin), None)
    if stdout is not None:
      os.close(pipes[1][1])
      pipes[1] = (None, os.dup(stdout))
    child_fds = [pipes[0][0], pipes[1][1], pipes[2][1]]
    try:
      self.pid = self._server.spawn([str(a) for a in argv], env, cwd, new_session,
                                    child_fds)
    finally:
      for fd in child_fds:
        os.close(fd)
    if pipes[0][1] is not None:
      os.close(pipes[0][1])  # stdin: at its end, as for a background process
    self.stdout = (None if stdout is not None else
                   open(pipes[1][0], encoding='utf-8', errors='replace'))
    self.stderr = open(pipes[2][0], encoding='utf-8', errors='replace')
    self.returncode = None

  def poll(self):
    if self.returncode is None:
      status = self._server.statuses.get(self.pid)
      if status is not None:
        self.returncode = os.waitstatus_to_exitcode(status)
    return self.returncode

  def wait(self, timeout=None):
    with self._server.ended:
      if not self._server.ended.wait_for(lambda: self.poll() is not None, timeout):
        raise subprocess.TimeoutExpired('fork of %s' % self.pid, timeout)
    return self.returncode

  def send_signal(self, sig):
    if self.poll() is None:
      os.kill(self.pid, sig)

  def kill(self):
    self.send_signal(signal.SIGKILL)

  def communicate(self, timeout=None):
    """(stdout, stderr) once both streams have ended and the process has exited."""
    texts = {}
    readers = [threading.Thread(target=lambda s=s: texts.setdefault(s, s.read()),
                                daemon=True) for s in (self.stdout, self.stderr) if s]
    for reader in readers:
      reader.start()
    self.wait(timeout)
    for reader in readers:
      reader.join(timeout)
    return texts.get(self.stdout, ''), texts.get(self.stderr, '')


def spawn_cli(args, env=None, stdout=None):
  """`python cli.py ARGS` as a user runs it, forked by the fork server (no
  TensorFlow import of its own): a Spawned."""
  return Spawned([CLI] + [str(a) for a in args], cli_env(env), stdout=stdout)


def invoke_cli(args, env=None):
  """The CLI in this process (click's CliRunner).

  Returns:
    (exit code, stdout, stderr, exception or None). An exception other than
    SystemExit is what a user would have seen as a traceback.
  """
  from click.testing import CliRunner
  from cifar10_towers import cli  # pylint: disable=import-outside-toplevel
  result = CliRunner().invoke(cli.cli, [str(a) for a in args], env=env)
  exception = result.exception
  if isinstance(exception, SystemExit):
    exception = None
  return result.exit_code, result.stdout, result.stderr, exception


def crosscheck_cli(monkeypatch, args):
  """`crosscheck ARGS` in this process, its one crosscheck.run recorded.

  Returns:
    (click's Result, what crosscheck.run returned: (reports, images, labels, init)).
  """
  from click.testing import CliRunner
  from cifar10_towers import cli  # pylint: disable=import-outside-toplevel
  from cifar10_towers import crosscheck  # pylint: disable=import-outside-toplevel
  runs, real_run = [], crosscheck.run

  def run(*args, **kwargs):
    runs.append(real_run(*args, **kwargs))
    return runs[-1]

  monkeypatch.setattr(crosscheck, 'run', run)
  result = CliRunner().invoke(cli.cli, ['crosscheck'] + [str(a) for a in args])
  assert len(runs) == 1, result.output
  return result, runs[0]


def crosscheck_run(num_towers, optimizer, **run_args):
  """crosscheck.run on num_towers of this process's devices, with optimizer (a dict of
  common.optimizer.OptimizerSpec's fields) and run_args as given (from JSON: `draws`
  holds lists, not tuples).

  Returns:
    (exit code as the CLI's: 0 when every report passed, else 1; the reports'
     tables; what crosscheck.run returned).
  """
  from cifar10_towers import crosscheck  # pylint: disable=import-outside-toplevel
  from cifar10_towers.common import devices  # pylint: disable=import-outside-toplevel
  # pylint: disable-next=import-outside-toplevel
  from cifar10_towers.common import optimizer as optimizer_lib
  run = crosscheck.run(devices.plan_devices(num_towers),
                       optimizer=optimizer_lib.OptimizerSpec(**optimizer), **run_args)
  reports = run[0]
  return (int(not all(r.passed for r in reports.values())),
          '\n'.join(f'legacy vs modern ({engine}):\n' + crosscheck.format_report(report)
                    for engine, report in reports.items()), run)


def crosscheck_in_background(arg_lists, out_dir):
  """`crosscheck ARGS` for each list of arg_lists, as crosscheck_cli runs them (or, for
  a dict, crosscheck_run on its arguments), but in a forked process
  (tests/crosscheck_child.py) while this one goes on.

  This process is single-threaded Python most of the time (graph building,
  tracing), which leaves one of two cores idle: a module's slowest
  cross-checks run there beside its other tests.

  Returns:
    A callable that waits for the runs: a list of (exit code, output, what
    crosscheck.run returned), one per list of arg_lists.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  path = os.path.join(out_dir, 'crosscheck_child.pickle')
  proc = Spawned([os.path.join(ROOT, 'tests', 'crosscheck_child.py'), path,
                  len(tf.config.list_logical_devices('CPU')),
                  json.dumps([args if isinstance(args, dict) else [str(a) for a in args]
                              for args in arg_lists])], cli_env())
  results = []

  def wait():
    if not results:
      _, err = proc.communicate(timeout=600)
      assert proc.returncode == 0, err[-3000:]
      with open(path, 'rb') as f:
        results.extend(pickle.load(f))
    errors = [error for *_, error in results if error]
    assert not errors, errors[0]
    return [result[:3] for result in results]
  wait.proc = proc
  return wait


class Running:
  """A `python cli.py ...` subprocess whose stdout lines are read as they come.

  forked: forked by the fork server (spawn_cli), which spares the process
  its TensorFlow import; for tests where that import is not the point.
  """

  def __init__(self, args, env=None, forked=False):
    if forked:
      self.proc = spawn_cli(args, env)
    else:
      self.proc = subprocess.Popen(
          [sys.executable, CLI] + [str(a) for a in args], cwd=ROOT,
          env=cli_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          text=True)
    self.lines = queue.Queue()
    self.stdout, self.stderr = [], []
    self.stdout_times = []  # when each stdout line arrived
    self._readers = [
        threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout, True),
                         daemon=True),
        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr, False),
                         daemon=True)]
    for reader in self._readers:
      reader.start()

  def _read(self, stream, sink, forward):
    for line in stream:
      sink.append(line.rstrip('\n'))
      if forward:
        self.stdout_times.append(time.time())
      if forward:
        self.lines.put(line.rstrip('\n'))
    if forward:
      self.lines.put(None)
    self.proc.wait()
    self.exited = time.time()  # when stdout closed and the process ended

  def wait_for(self, predicate, timeout=120):
    """The first stdout line satisfying predicate; None if the process ended."""
    deadline = time.time() + timeout
    while True:
      try:
        line = self.lines.get(timeout=max(0.0, deadline - time.time()))
      except queue.Empty:
        raise AssertionError('no matching line within %d s; stdout:\n%s\nstderr:\n%s'
                             % (timeout, '\n'.join(self.stdout[-5:]),
                                '\n'.join(self.stderr[-20:])))
      if line is None or predicate(line):
        return line

  def finish(self, timeout=60):
    """Waits for exit; returns (exit code, stdout text, stderr text)."""
    code = self.proc.wait(timeout=timeout)
    for reader in self._readers:
      reader.join(timeout=10)
    return code, '\n'.join(self.stdout), '\n'.join(self.stderr)

  def kill(self):
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGKILL)
    return self.finish()


def snapshot(*roots):
  """{path: sha256} of every file under the roots that exist."""
  digests = {}
  for root in roots:
    if os.path.isfile(root):
      paths = [root]
    else:
      paths = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
    for path in paths:
      with open(path, 'rb') as f:
        digests[path] = hashlib.sha256(f.read()).hexdigest()
  return digests


def changed(before, after):
  """Paths of `before` that are gone or whose bytes differ in `after`."""
  return sorted(p for p, digest in before.items() if after.get(p) != digest)


# free_ports' ports: below Linux's ephemeral range (32768-60999, where the OS picks
# port 0's and client connections' ports), a range of its own for each pytest-xdist
# worker (gw0, gw1, ...). Ports picked by the OS were shared: two workers' clusters,
# started at the same moment, got the same port and joined each other's.
PORTS_PER_WORKER = 2000


def free_ports(count):
  """`count` distinct TCP ports free on 127.0.0.1 right now (for loopback workers),
  from this pytest-xdist worker's own range."""
  low = 20000 + PORTS_PER_WORKER * int(os.environ.get('PYTEST_XDIST_WORKER', 'gw0')[2:])
  ports = []
  for port in random.Random().sample(range(low, low + PORTS_PER_WORKER), PORTS_PER_WORKER):
    with socket.socket() as s:
      try:
        s.bind(('127.0.0.1', port))
      except OSError:  # in use, or lingering after an earlier test's process
        continue
    ports.append(port)
    if len(ports) == count:
      return ports
  raise RuntimeError(f'fewer than {count} free ports in {low}-{low + PORTS_PER_WORKER - 1}')


def closed_port_url():
  """An http URL on 127.0.0.1 where nothing listens (no network is touched)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  return 'http://127.0.0.1:%d/cifar-10-binary.tar.gz' % port


def flip_bytes(path, offset=None, count=16):
  """Inverts `count` bytes in the middle of a file (or at `offset`)."""
  size = os.path.getsize(path)
  offset = size // 2 if offset is None else offset
  with open(path, 'r+b') as f:
    f.seek(offset)
    data = f.read(count)
    f.seek(offset)
    f.write(bytes(b ^ 0xff for b in data))


def data_file(path):
  return path + '.data-00000-of-00001'


# --- checkpoints made once per test session, copied into each test ----------

_TRAINED = {}


def trained_dir(impl, data_dir):
  """A train_dir of `impl` holding model.ckpt-1 and model.ckpt-2 (cached).

  Trained in this process (batch 8, one tower), so it costs ~2 s, not a
  TensorFlow import. Copy it with `copy_trained`; never modify it.
  """
  if impl not in _TRAINED:
    from cifar10_towers.runtime import config as config_lib
    from cifar10_towers.common import devices
    path = tempfile.mkdtemp(prefix='faults_%s_' % impl)
    config = config_lib.TrainConfig(
        data_dir=data_dir, train_dir=path, num_gpus=1, batch_size=8,
        max_steps=2, save_every=1, log_every=100, summary_every=1000, seed=0)
    plan = devices.plan_devices(1)
    if impl == 'legacy':
      from cifar10_towers.legacy import train
      train.train(config, plan, num_threads=2)
    else:
      from cifar10_towers.modern import train
      train.train(config, plan)
    for name in os.listdir(path):  # keep the checkpoints only
      if name.startswith('events.out.tfevents'):
        os.remove(os.path.join(path, name))
    _TRAINED[impl] = path
  return _TRAINED[impl]


def copy_trained(impl, data_dir, dst):
  shutil.copytree(trained_dir(impl, data_dir), dst)
  return dst


@atexit.register
def _cleanup_trained():
  for path in _TRAINED.values():
    shutil.rmtree(path, ignore_errors=True)
  _TRAINED.clear()


def at_call(nth, action, func):
  """`func`, running `action()` first at its nth call (an in-process hook)."""
  calls = []

  def wrapper(*args, **kwargs):
    calls.append(None)
    if len(calls) == nth:
      action()
    return func(*args, **kwargs)
  return wrapper


# --- mounts (root only) -----------------------------------------------------
# mount(2) and umount2(2) themselves, not the `mount` command: no process.

_LIBC = ctypes.CDLL(None, use_errno=True)
_MS_RDONLY, _MS_REMOUNT = 1, 32


def _mount(source, path, fstype, flags, options):
  if _LIBC.mount(source, os.fsencode(path), fstype, flags,
                 options.encode() if options else None) != 0:
    error = ctypes.get_errno()
    raise OSError(error, os.strerror(error), path)


def mount_tmpfs(path, size, read_only=False):
  """Mounts a tmpfs of `size` (e.g. '10m') at path; False if not permitted."""
  os.makedirs(path, exist_ok=True)
  try:
    _mount(b'tmpfs', path, b'tmpfs', _MS_RDONLY if read_only else 0, 'size=%s' % size)
  except OSError:
    return False
  return True


def remount(path, options):
  """Remounts path 'ro', or read-write with a tmpfs option such as 'size=64m'."""
  read_only = options == 'ro'
  _mount(None, path, None, _MS_REMOUNT | (_MS_RDONLY if read_only else 0),
         None if read_only else options)


def umount(path):
  _LIBC.umount2(os.fsencode(path), 0)  # a failure is ignored, as it was


# --- a train_dir as the upstream script left it ------------------------------

UPSTREAM_STEP = 30  # the global step saved in upstream_train_dir's checkpoint


def upstream_train_dir(path, step=UPSTREAM_STEP, seed=0):
  """A train_dir as upstream's cifar10_multi_gpu_train.py wrote it.

  A tf.compat.v1 graph with a float32 `global_step` (ours is int64), the ten
  model variables and their `<name>/ExponentialMovingAverage` shadows, saved
  by a v1 Saver under upstream's name: the 0-based loop index, so
  `model.ckpt-<step - 1>` holds global_step `step`; the `checkpoint` state
  file holds absolute paths, as upstream's Saver wrote them.

  Returns:
    str, the checkpoint prefix.
  """
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from cifar10_towers.common import model_spec  # pylint: disable=import-outside-toplevel
  tf1 = tf.compat.v1
  os.makedirs(path, exist_ok=True)
  rng = np.random.default_rng(seed)
  with tf.Graph().as_default():
    for name in model_spec.VARIABLE_NAMES:
      value = rng.normal(0.0, 0.05, model_spec.variable_shape(name))
      tf1.Variable(value.astype(np.float32), name=name)
      tf1.Variable((0.9 * value).astype(np.float32),
                   name=name + '/ExponentialMovingAverage', trainable=False)
    tf1.Variable(float(step), dtype=tf.float32, name='global_step',
                 trainable=False)
    saver = tf1.train.Saver(tf1.global_variables())  # absolute paths
    with tf1.Session() as sess:
      sess.run(tf1.global_variables_initializer())
      return saver.save(sess, os.path.join(os.path.abspath(path), 'model.ckpt'),
                        global_step=step - 1)


# --- hooks: a marker line and a pause at a chosen call of a CLI run ----------

_HOOKS_MODULE = '''"""Test hooks of tests/faults_support.hooks_env (FAULTS_HOOKS), nothing else."""
import functools
import importlib.abc
import json
import os
import signal
import sys
import time

_HOOKS = json.loads(os.environ.get('FAULTS_HOOKS', '[]'))
_MODULES = {hook['at'].split(':')[0] for hook in _HOOKS}


def _wrap(func, hook):
  calls = [0]

  @functools.wraps(func)
  def wrapper(*args, **kwargs):
    calls[0] += 1
    if calls[0] == hook.get('nth', 1):
      # The pause ends `dwell` seconds after the line, whenever it begins: a
      # run frozen (SIGSTOP) right after the line, before its sleep, must not
      # sleep the whole pause again once thawed (tests freeze at the line).
      until = time.monotonic() + hook.get('dwell', 0)
      if 'say' in hook:
        print(hook['say'], flush=True)
      if hook.get('freeze'):  # stopped at the line itself, however late a test reads it
        os.kill(os.getpid(), signal.SIGSTOP)
      time.sleep(max(0.0, until - time.monotonic()))
    if 'returns' in hook:
      return hook['returns']
    return func(*args, **kwargs)
  return wrapper


def _apply(module):
  for hook in _HOOKS:
    name, path = hook['at'].split(':')
    if name == module.__name__:
      owner, parts = module, path.split('.')
      for part in parts[:-1]:
        owner = getattr(owner, part)
      setattr(owner, parts[-1], _wrap(getattr(owner, parts[-1]), hook))


class _Finder(importlib.abc.MetaPathFinder):
  """Lets the other finders find a hooked module, then hooks it once loaded."""

  def find_spec(self, fullname, path, target=None):
    if fullname not in _MODULES:
      return None
    for finder in sys.meta_path:
      if finder is not self and hasattr(finder, 'find_spec'):
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
          break
    else:
      return None
    exec_module = spec.loader.exec_module

    def exec_and_hook(module):
      exec_module(module)
      _apply(module)
    spec.loader.exec_module = exec_and_hook
    return spec


if _HOOKS:
  sys.meta_path.insert(0, _Finder())
  for _name in _MODULES & set(sys.modules):  # loaded already (a fork server's child)
    _apply(sys.modules[_name])
'''


# The subpackages of cifar10_towers, which `hook` names without the prefix.
PROJECT_PACKAGES = ('common', 'runtime', 'datasets', 'legacy', 'modern', 'towerprofile')


def hook(at, say=None, dwell=0.0, nth=1, returns=None, freeze=False):
  """One hook of `hooks_env`: at the nth call of `at`.

  `at` is a function or method of the product itself (e.g.
  `engines.Towers.write_summaries`), named where the test module is
  collected, so that a rename fails there; or 'module:attr.path', the
  project's modules named inside the cifar10_towers package
  ('common.devices:...'), others in full ('tensorflow.python...:...').
  Prints `say` on stdout and pauses until `dwell` seconds after it before the call goes on,
  or returns `returns` instead of calling (when given). `freeze`: right after the
  line the run stops itself (SIGSTOP), as `Frozen` would stop it there: on a
  busy machine a test may read the line after the pause has run out, and
  freeze the run past the phase (a SIGCONT lets it go on).
  """
  if callable(at):
    at = f'{at.__module__}:{at.__qualname__}'
  elif at.split('.')[0] in PROJECT_PACKAGES:
    at = 'cifar10_towers.' + at
  spec = {'at': at, 'nth': nth, 'dwell': dwell, 'freeze': freeze}
  if say is not None:
    spec['say'] = say
  if returns is not None:
    spec['returns'] = returns
  return spec


def hooks_env(directory, hooks, extra=None):
  """The env of a `python cli.py` run (run_cli, Running) with `hooks` installed.

  Writes a sitecustomize module into `directory`, which the run imports at
  start-up: it wraps each hooked function as its module is first imported,
  so a test sees a line when a phase begins (and freezes or signals the run
  right there) without any hook in the code under test.
  """
  os.makedirs(directory, exist_ok=True)
  with open(os.path.join(directory, 'sitecustomize.py'), 'w', encoding='utf-8') as f:
    f.write(_HOOKS_MODULE)
    # This sitecustomize shadows tests/tf_noise's: carry the noise switch too.
    with open(os.path.join(ROOT, 'tests', 'tf_noise', 'sitecustomize.py'),
              encoding='utf-8') as noise:
      f.write('\n\n' + noise.read())
  path = os.environ.get('PYTHONPATH')
  env = {'PYTHONPATH': directory + (os.pathsep + path if path else ''),
         'FAULTS_HOOKS': json.dumps(hooks)}
  env.update(extra or {})
  return env


class Frozen:
  """Freezes a Running (SIGSTOP) as soon as a stdout line satisfies `predicate`.

  A thread of its own waits for the line, so many runs can be frozen each at
  its own moment. `line` is that line (None if the run ended first), and
  `frozen_at` the time.time() of the freeze. itself: the line is a hook's with
  `freeze` (the run stops itself right after it), so the run is only watched
  until it has stopped: a SIGSTOP of ours could come between the line and the
  run's own, which would then stop it again after the test's SIGCONT.
  """

  def __init__(self, run, predicate, timeout=240, itself=False):
    self.run = run
    self.line = None
    self.frozen_at = None
    self.error = None
    self._thread = threading.Thread(target=self._watch, args=(predicate, timeout, itself),
                                    daemon=True)
    self._thread.start()

  def _watch(self, predicate, timeout, itself):
    try:
      self.line = self.run.wait_for(predicate, timeout=timeout)
    except AssertionError as e:  # no line in time
      self.error = str(e)
      return
    if self.line is not None and self.run.proc.poll() is None:
      if not itself:
        self.run.proc.send_signal(signal.SIGSTOP)
      deadline = time.monotonic() + timeout
      while not _stopped(self.run.proc.pid) and self.run.proc.poll() is None:
        if time.monotonic() > deadline:
          self.error = f'the run did not stop within {timeout} s of {self.line!r}'
          return
        time.sleep(0.01)
      self.frozen_at = time.time()

  def wait(self, timeout=300):
    """Waits until frozen (or ended); returns the line."""
    self._thread.join(timeout)
    assert not self._thread.is_alive(), 'still waiting for the line'
    assert self.error is None, self.error
    return self.line


def _stopped(pid):
  """Whether process `pid` is stopped (SIGSTOP): its state in /proc/PID/stat."""
  try:
    with open(f'/proc/{pid}/stat', encoding='ascii', errors='replace') as f:
      return f.read().rsplit(')', 1)[1].split()[0] in 'Tt'
  except (OSError, IndexError):
    return False


def exit_bound(seconds):
  """`seconds`, stretched by how oversubscribed the CPUs are right now.

  A wall-clock bound on a machine busy with other work only means something
  per share of CPU the process gets.
  """
  load = os.getloadavg()[0] / (os.cpu_count() or 1)
  return seconds * max(1.0, load)


# --- TensorBoard event files --------------------------------------------------

def precision_points(eval_dir, tag='Precision @ 1'):
  """[(step, value)] of the scalar `tag` in eval_dir, as TensorBoard reads it.

  With tensorboard installed, its own reader: the scalar must be in the
  scalars dashboard (plugin 'scalars'). Without it, the raw events.
  """
  import numpy as np
  import tensorflow as tf
  try:
    from tensorboard.backend.event_processing import plugin_event_accumulator
  except ImportError:
    plugin_event_accumulator = None
  if plugin_event_accumulator is not None:
    accumulator = plugin_event_accumulator.EventAccumulator(eval_dir)
    accumulator.Reload()
    if tag not in accumulator.PluginTagToContent('scalars'):
      return []
    return [(e.step, float(tf.make_ndarray(e.tensor_proto)))
            for e in accumulator.Tensors(tag)]
  points = []
  for name in sorted(os.listdir(eval_dir)):
    for event in tf.compat.v1.train.summary_iterator(os.path.join(eval_dir, name)):
      for value in event.summary.value:
        if value.tag == tag:
          assert value.metadata.plugin_data.plugin_name == 'scalars', value
          points.append((event.step, float(np.squeeze(tf.make_ndarray(value.tensor)))))
  return points


SUMMARY_PLUGINS = ('scalars', 'histograms', 'images')  # TensorBoard's, as summary_tags keys them


def read_tags(train_dir):
  """{'scalars', 'histograms', 'images'} -> sorted tags, and whether a graph is there.

  TensorBoard's own reader (the plugin accumulator), which shows legacy's
  TF1 summaries and modern's tf.summary tensors alike, by plugin. The
  accumulator is returned too.
  """
  from tensorboard.backend.event_processing import plugin_event_accumulator
  acc = plugin_event_accumulator.EventAccumulator(
      str(train_dir), size_guidance={plugin_event_accumulator.TENSORS: 0})
  acc.Reload()
  tags = {plugin: sorted(acc.PluginTagToContent(plugin))
          if plugin in acc.ActivePlugins() else [] for plugin in SUMMARY_PLUGINS}
  return tags, acc.Tags()['graph'], acc


class ScriptedStop:
  """A stand-in StopRequest for runtime.evaluation.run: never stops; each wait
  runs the next scripted change (a save, a deletion) instead of sleeping."""

  def __init__(self, *changes):
    self.changes = list(changes)
    self.requested = False
    self.signal_name = None

  def wait(self, timeout):
    del timeout
    if self.changes:
      self.changes.pop(0)()
    return False


def move_checkpoint(train_dir, step, to_dir):
  """Moves model.ckpt-<step>'s files from train_dir to to_dir (created if missing)."""
  os.makedirs(to_dir, exist_ok=True)
  for name in os.listdir(train_dir):
    if name.startswith('model.ckpt-%d.' % step):
      shutil.move(os.path.join(train_dir, name), os.path.join(to_dir, name))


def name_latest(train_dir, step):
  """Writes train_dir's `checkpoint` state file naming model.ckpt-<step> alone."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  tf.compat.v1.train.update_checkpoint_state(
      train_dir, 'model.ckpt-%d' % step, ['model.ckpt-%d' % step])
