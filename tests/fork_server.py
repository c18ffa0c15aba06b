"""A fork server for `python cli.py` processes: TensorFlow imported once, not per process.

Run by tests/faults_support.spawn as `python fork_server.py FD`: FD is its end
of a SOCK_SEQPACKET socket pair. It imports TensorFlow (the ~5-7 s of CPU
each `python cli.py` would spend), says b'ready', then for each request
(JSON {argv, env, cwd, new_session} with the three stdio file descriptors)
forks a child, answers {"pid": N}, and once that child ends
{"exit": N, "status": waitpid status}. The child becomes `python ARGV...`:
its stdio, environment, working directory, sys.argv and sys.path[0] as a
fresh interpreter's, the PYTHONPATH's sitecustomize (a test's hooks) run
again, and the script run as __main__; it exits through the interpreter's
own shutdown, as any Python process. Nothing of the project is imported
here, so every project module loads (and is hooked) in the child.

What a child does not repeat is the TensorFlow import itself: tests of
what happens during that import use a real fresh process (fs.Running with
fresh=True).
"""

import json
import os
import socket
import sys

_sock = socket.socket(fileno=int(sys.argv[1]))
import tensorflow  # pylint: disable=unused-import,wrong-import-position
import tensorflow.compat.v1  # pylint: disable=unused-import,wrong-import-position

_sock.sendall(b'ready')
_sock.settimeout(0.05)
_request = None
while _request is None:
  try:
    _message, _fds, _, _ = socket.recv_fds(_sock, 1 << 20, 3)
  except socket.timeout:
    _message = None
  if _message == b'':  # the test session ended: no interpreter shutdown to wait for
    os._exit(0)
  if _message is not None:
    _pid = os.fork()
    if _pid == 0:
      _request = json.loads(_message)
      break
    for _fd in _fds:
      os.close(_fd)
    _sock.sendall(json.dumps({'pid': _pid}).encode())
  while True:  # reap
    try:
      _pid, _status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      break
    if _pid == 0:
      break
    _sock.sendall(json.dumps({'exit': _pid, 'status': _status}).encode())

# --- the child: `python ARGV` ---
_sock.close()
for _target, _fd in enumerate(_fds):
  os.dup2(_fd, _target)
  os.close(_fd)
if _request['new_session']:
  os.setsid()
os.chdir(_request['cwd'])
os.environ.clear()
os.environ.update(_request['env'])
sys.argv = list(_request['argv'])
_script_dir = os.path.dirname(os.path.abspath(sys.argv[0]))
_python_path = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
sys.path[:] = [_script_dir] + _python_path + [
    p for p in sys.path if p and p not in _python_path]
for _entry in _python_path:  # the first sitecustomize, as at start-up
  _path = os.path.join(_entry, 'sitecustomize.py')
  if os.path.isfile(_path):
    import importlib.util  # pylint: disable=wrong-import-position
    _spec = importlib.util.spec_from_file_location('sitecustomize', _path)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules['sitecustomize'] = _module
    _spec.loader.exec_module(_module)
    # TensorFlow's noise (CIFAR10_TOWERS_TF_NOISE=1) comes after its import,
    # which this child does not repeat: at its start, and again 2 s later.
    if hasattr(_module, 'emit') and os.environ.get('CIFAR10_TOWERS_TF_NOISE') == '1':
      import threading  # pylint: disable=wrong-import-position
      for _delay in (0.5, 2.5):
        _timer = threading.Timer(_delay, _module.emit)
        _timer.daemon = True
        _timer.start()
    break
del _sock, _request, _fds
import runpy  # pylint: disable=wrong-import-position
runpy.run_path(sys.argv[0], run_name='__main__')
