"""Keeps TensorFlow's known start-up noise off the user's stderr, and nothing else.

TensorFlow's C++ writes a few lines to file descriptor 2 that
TF_CPP_MIN_LOG_LEVEL does not silence (absl's pre-init warning, oneDNN's
notices; which ones depends on the CPU). `install` routes fd 2 through a pipe
read by a thread of this process, which drops exactly those lines (KNOWN) and
passes every other line on to the real stderr at once. In-process, not a
wrapper process: the PID the train_dir lock names and the process that
receives signals stay the user's. TensorFlow's arithmetic is untouched
(TF_ENABLE_ONEDNN_OPTS=0 would change speed and numerics).

`restore` flushes what the pipe holds and gives fd 2 back; it runs at exit,
and `ending` writes a run's last line straight to the real stderr, where
nothing can hold it back.
"""

import atexit
import os
import re
import threading

# Lines TensorFlow writes on some CPUs whatever TF_CPP_MIN_LOG_LEVEL says.
# absl's prefix: severity, MMDD, time, thread id, file:line].
_ABSL = r'[IWEF]\d{4} [\d:.]+\s+\d+ '
KNOWN = re.compile('|'.join([
    r'WARNING: All log messages before absl::InitializeLog\(\) is called are '
    r'written to STDERR',
    _ABSL + r'port\.cc:\d+\] oneDNN custom operations are on\b.*',
    _ABSL + r'util\.cc:\d+\] oneDNN supports DT_UINT8 only on platforms with '
    r'AVX-512\b.*',
]))

_END = b'\x00cifar10-towers stderr filter: end\x00'  # written once, by `restore`
_state = None  # (real stderr fd, the pipe's write end, reader thread) while installed
_lock = threading.Lock()


def install():
  """Filters fd 2 for the rest of the process; a no-op when already installed."""
  global _state  # pylint: disable=global-statement
  with _lock:
    if _state is not None:
      return
    real = os.dup(2)
    read_end, write_end = os.pipe()  # both non-inheritable
    os.dup2(write_end, 2)  # fd 2 itself stays inheritable: children write here
    thread = threading.Thread(target=_pump, args=(read_end, real),
                              name='stderr-filter', daemon=True)
    thread.start()
    _state = (real, write_end, thread)
  atexit.register(restore)


def _pump(read_end, real):
  pending = b''
  with os.fdopen(read_end, 'rb', buffering=0) as pipe:
    while True:
      chunk = pipe.read(65536)
      if not chunk:
        break
      pending += chunk
      end = pending.find(_END)
      if end >= 0:
        pending = pending[:end]
      *lines, pending = pending.split(b'\n')
      _write(real, b''.join(line + b'\n' for line in lines if not _known(line)))
      if end >= 0:
        break
  if pending and not _known(pending):
    _write(real, pending + b'\n')  # what comes after starts on a line of its own


def _known(line):
  return KNOWN.fullmatch(line.decode('utf-8', 'replace').rstrip('\r')) is not None


def _write(fd, data):
  while data:
    try:
      data = data[os.write(fd, data):]
    except OSError:  # the real stderr is gone (closed terminal, pipe): drop it
      return


def restore():
  """Passes on what the filter's pipe holds and gives fd 2 back to the real stderr.

  Runs at exit, and must run before any exit that skips atexit (os._exit, a
  signal's default action). A child started with fd 2 may still hold the
  pipe, so the end is a marker, not end-of-file.
  """
  global _state  # pylint: disable=global-statement
  with _lock:
    if _state is None:
      return
    real, write_end, thread = _state
    _state = None
  import sys  # pylint: disable=import-outside-toplevel
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError, AttributeError):
      pass
  os.dup2(real, 2)  # from here on, fd 2 writes go straight out
  _write(write_end, _END)
  os.close(write_end)
  thread.join(timeout=5)
  os.close(real)


def ending(line):
  """Writes a run's one ending line to the real stderr, after all before it; never raises."""
  restore()
  _write(2, (line.rstrip('\n') + '\n').encode('utf-8', 'replace'))


def real_stderr():
  """The fd of the real stderr (2 when no filter is installed), for a child that outlives us."""
  with _lock:
    return _state[0] if _state is not None else 2
