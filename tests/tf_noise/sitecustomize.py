"""The test switch CIFAR10_TOWERS_TF_NOISE=1: every Python process writes TensorFlow's noise.

On some CPUs TensorFlow's C++ writes lines to file descriptor 2 that
TF_CPP_MIN_LOG_LEVEL does not silence; on others it writes none. With the
switch on (conftest.py puts this directory on PYTHONPATH, so every Python
process the suite starts imports this file at start-up), each process writes
those lines itself, with a fresh timestamp and file:line each time, right
after `import tensorflow` and again a few seconds later, plus one line no
filter knows (UNKNOWN_LINE), which must still reach the user. So the suite
passes on a quiet machine only if it would pass on a noisy one.
"""

import importlib.abc
import importlib.util
import os
import random
import sys
import threading
import time

UNKNOWN_MARK = 'cifar10-towers test noise: an unknown TensorFlow error'


def _absl(severity, source, text):
  now = time.time()
  stamp = time.strftime('%m%d %H:%M:%S', time.localtime(now))
  return '%s%s.%06d %7d %s:%d] %s\n' % (
      severity, stamp, int(now % 1 * 1e6), threading.get_native_id(), source,
      random.randint(1, 999), text)


def noise():
  """The three known lines, with varying stamps and file:line, and the unknown one."""
  return ''.join([
      'WARNING: All log messages before absl::InitializeLog() is called are '
      'written to STDERR\n',
      _absl('I', 'port.cc', 'oneDNN custom operations are on. You may see '
            'slightly different numerical results due to floating-point '
            'round-off errors from different computation orders. To turn them '
            'off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.'),
      _absl('E', 'util.cc', 'oneDNN supports DT_UINT8 only on platforms with '
            'AVX-512. Falling back to the default Eigen-based implementation '
            'if present.'),
      _absl('E', 'fake_noise.cc', UNKNOWN_MARK + ' (a line no filter knows).'),
  ])


def emit():
  try:
    os.write(2, noise().encode())
  except OSError:
    pass


class _AfterTensorFlow(importlib.abc.MetaPathFinder):
  """Emits the noise once `import tensorflow` has run, and again 2 s later."""

  def find_spec(self, name, path=None, target=None):
    del path, target
    if name != 'tensorflow':
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
      return spec
    exec_module = spec.loader.exec_module

    def exec_then_emit(module):
      exec_module(module)
      emit()
      timer = threading.Timer(2.0, emit)
      timer.daemon = True
      timer.start()

    spec.loader.exec_module = exec_then_emit
    return spec


if os.environ.get('CIFAR10_TOWERS_TF_NOISE') == '1':
  sys.meta_path.insert(0, _AfterTensorFlow())
