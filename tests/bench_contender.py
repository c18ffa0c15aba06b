"""bench's contender processes forked by tests/fork_server.py, not spawned.

`bench.Contender` starts each contender as a fresh interpreter
(multiprocessing's spawn), which imports TensorFlow: ~5-7 s of CPU each, six
times in one bench run. `Forked` is the same contender forked by the fork
server (TensorFlow imported once) running the same entry point,
`bench.contend`, on the same connection: its own process, its own windows,
clocks and peak RSS. tests/test_bench.py's test_a_failing_contender_is_a_bench_error
keeps a real spawned one, and .ci/run runs the README's `bench` as it ships.

Run as `python bench_contender.py` (by the fork server) with its stdin the
contender's end of a socket: it reads (spec, stderr_path) from it and runs
`bench.contend`.
"""

import os
import socket
import sys
import tempfile
from multiprocessing import connection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Process:
  """The face of multiprocessing.Process that bench.Contender uses, on a Spawned."""

  def __init__(self, spawned):
    self._spawned = spawned

  @property
  def exitcode(self):
    return self._spawned.poll()

  def join(self):
    self._spawned.wait()
    for stream in (self._spawned.stdout, self._spawned.stderr):
      stream.close()  # (its stdio is its own files by then: nothing was written here)

  def kill(self):
    self._spawned.kill()


def forked_contender():
  """A bench.Contender subclass whose process is forked by the fork server."""
  import faults_support as fs  # pylint: disable=import-outside-toplevel
  from cifar10_towers import bench  # pylint: disable=import-outside-toplevel

  class Forked(bench.Contender):
    """bench.Contender, its process `python bench_contender.py` from the fork server."""

    def __init__(self, spec):  # pylint: disable=super-init-not-called
      self.spec = spec
      self._stderr = tempfile.NamedTemporaryFile(mode='w+', prefix='bench_stderr_')
      ours, theirs = socket.socketpair()
      try:
        self._proc = _Process(fs.Spawned([os.path.abspath(__file__)], fs.cli_env(),
                                         stdin=theirs.fileno()))
      finally:
        theirs.close()  # the contender's end: its exit is then our EOF
      self._conn = connection.Connection(ours.detach())
      self._conn.send((spec, self._stderr.name))

  return Forked


if __name__ == '__main__':
  sys.path.insert(0, ROOT)
  from cifar10_towers import bench  # pylint: disable=wrong-import-position
  _conn = connection.Connection(os.dup(0))
  os.close(0)
  os.open(os.devnull, os.O_RDONLY)  # fd 0 again: nothing to read, as a spawned child's
  _spec, _stderr_path = _conn.recv()
  bench.contend(_spec, _conn, _stderr_path)
