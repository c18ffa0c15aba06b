"""Keeps TensorFlow's known start-up noise off the user's stderr, and nothing else.

TensorFlow's C++ writes a few lines to file descriptor 2 that
TF_CPP_MIN_LOG_LEVEL does not silence (absl's pre-init warning, oneDNN's
notices; which ones depends on the CPU). `install` routes fd 2 through a pipe
read by a thread of this process, which drops exactly those lines (KNOWN) and
passes every other line on to the real stderr at once. In-process, not a
wrapper process: the PID the train_dir lock names and the process that
receives signals stay the user's. TensorFlow's arithmetic is untouched
(TF_ENABLE_ONEDNN_OPTS=0 would change speed and numerics).

`restore` passes on what the pipe holds and gives fd 2 back; it runs at exit.
`say` writes a line of its own past the filter, after everything before it.
"""

import atexit
import os
import re
import sys
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

# Markers written into the pipe by this module alone: `say`'s line starts on a
# line of its own; everything before the end has been passed on when `restore`
# gives fd 2 back (a child may still hold the pipe: there is no end-of-file).
_SAY = b'\x00cifar10-towers stderr filter: say\x00'
_END = b'\x00cifar10-towers stderr filter: end\x00'
# While installed: (the real stderr's fd, the pipe's write end, the thread reading the pipe).
_state = None
_lock = threading.RLock()  # re-entrant: a signal handler in the main thread may call restore


def _pump(read_end, real):
  """Passes what comes through the pipe on to `real`, but the known lines, until _END."""
  pending = b''
  with os.fdopen(read_end, 'rb', buffering=0) as pipe:
    while chunk := pipe.read(65536):
      # After a partial line `say`'s mark is a newline; elsewhere nothing.
      pending = re.sub(rb'(?<=[^\n])' + re.escape(_SAY), b'\n', pending + chunk)
      pending = pending.replace(_SAY, b'')
      if _END in pending:
        pending = pending.split(_END)[0]
        break
      *lines, pending = pending.split(b'\n')
      _pass(real, lines)
  lines = pending.split(b'\n')
  _pass(real, lines if lines[-1] else lines[:-1])  # a last partial line too, ended


def _pass(real, lines):
  """Writes each of `lines` (without its newline) to `real`, but the known ones."""
  _write(real, b''.join(l + b'\n' for l in lines if not KNOWN.fullmatch(
      l.decode('utf-8', 'replace').rstrip('\r'))))


def install():
  """Filters fd 2 for the rest of the process; a no-op when already installed."""
  global _state  # pylint: disable=global-statement
  with _lock:
    if _state:
      return
    try:
      real = os.dup(2)
    except OSError:  # fd 2 closed (`2>&-`, a daemon): what stderr gets goes nowhere
      real = os.open(os.devnull, os.O_WRONLY)
    read_end, write_end = os.pipe()  # both non-inheritable
    os.dup2(write_end, 2)  # fd 2 itself stays inheritable: children write here
    if sys.stderr is None:  # Python found fd 2 closed: without this, click writes to stdout
      sys.stderr = open(2, 'w', buffering=1, closefd=False)  # pylint: disable=consider-using-with
    thread = threading.Thread(target=_pump, args=(read_end, real), name='stderr-filter',
                              daemon=True)
    thread.start()
    _state = real, write_end, thread
    atexit.register(restore)


def _write(fd, data):
  while data:
    try:
      data = data[os.write(fd, data):]
    except OSError:  # the real stderr is gone (closed terminal, pipe): drop it
      return


def flush_python():
  """Flushes sys.stdout and sys.stderr, quietly (either may be closed, or None)."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError, AttributeError):
      pass


def restore():
  """Passes on what the filter's pipe holds and gives fd 2 back to the real stderr.

  Runs at exit, and must run before any exit that skips atexit (os._exit, a
  signal's default action). A child started with fd 2 may still hold the
  pipe, so the end is a marker, not end-of-file.
  """
  global _state  # pylint: disable=global-statement
  with _lock:
    state, _state = _state, None
  if state:
    real, write_end, thread = state
    flush_python()
    os.dup2(real, 2)  # from here on, fd 2 writes go straight out
    _write(write_end, _END)
    os.close(write_end)
    thread.join(timeout=5)
    os.close(real)


def say(line):
  """Writes one line to stderr, on a line of its own, after everything written before it.

  Through the filter's pipe, in order (`restore` passes it on before any
  exit); with os.write, so a signal's handler may call it while Python
  writes to sys.stderr. Without the filter (a library call, a test's
  CliRunner), to sys.stderr. Never raises.
  """
  if not _state:
    try:
      print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
      pass
    return
  flush_python()
  _write(2, _SAY + f'{line}\n'.encode('utf-8', 'replace'))


def real_stderr():
  """The fd of the real stderr (2 when no filter is installed), for a child that outlives us."""
  with _lock:
    return _state[0] if _state else 2
