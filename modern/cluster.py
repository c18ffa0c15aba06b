"""The workers of a multiworker run, and their start-up before TensorFlow's.

No TensorFlow here, so that the CLI checks its flags at once and the checks
below run where a signal still reaches Python.

TensorFlow's own start-up (`tf.distribute.MultiWorkerMirroredStrategy`, which
starts this process's gRPC server and waits for every worker to register)
runs inside one C++ call that holds Python's global interpreter lock: while
it waits, no Python thread runs (no watchdog, no signal handler), and
TensorFlow's preemption notifier takes SIGTERM for itself. A worker started
alone waited there for good. So the workers first meet here, in Python:

  check_hosts    every host name resolves (this worker's and its peers');
  listen         this worker's port is free: the bind test, on a socket that
                 then answers the peers' hellos;
  rendezvous     every peer has said hello with the same cluster, or
                 StartupError names the ones that never answered.

Only then does TensorFlow's start-up begin, with all workers up: it takes a
second, bounded by `modern.engines` as a backstop.

Our own code, not TensorFlow's coordination service: tried with TF 2.21, a
worker whose peer never starts waited in MultiWorkerMirroredStrategy's
start-up for over 10 minutes with the coordination service's
cluster_register_timeout_in_ms at 8 s, no Python thread ran meanwhile, and
its SIGTERM went to TensorFlow's preemption notifier and was ignored. The
tests that need this are tests/test_faults_multiworker.py's 'lone chief past
--startup_timeout' (the message names the peers that never answered),
'SIGTERM during the start-up', 'SIGINT during the start-up' and 'different
clusters' (TensorFlow has no hello that compares the workers' lists).
"""

import dataclasses
import json
import logging
import os
import socket
import threading
import time

from cifar10_towers.common import errors
from cifar10_towers.runtime import training

logger = logging.getLogger(__name__)

TF_CONFIG = 'TF_CONFIG'  # the environment variable naming the cluster
HELLO = 'cifar10-towers multiworker hello'  # first word of the start-up handshake
CONNECT_SECS = 1.0  # one attempt to reach a peer's port
RETRY_SECS = 0.5  # between attempts to reach a peer
_EXAMPLE = ('{"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')


class ClusterError(errors.Failure):
  """The cluster description is missing or malformed; the message says what to do."""


class StartupError(training.TrainingError):
  """The workers could not start together; the message names the hosts and ports."""


@dataclasses.dataclass(frozen=True)
class Cluster:
  """The workers of a multi-worker run and which of them this process is."""
  jobs: dict  # job name ('chief', 'worker') -> tuple of 'host:port'
  task_type: str  # this process's job, 'worker' or 'chief'
  task_id: int  # this process's index within its job
  source: str = '--worker_hosts'  # where it came from: '--worker_hosts' or 'TF_CONFIG'

  @property
  def hosts(self):
    """'host:port' of every worker in worker_index order (the chief first)."""
    return self.jobs.get('chief', ()) + self.jobs.get('worker', ())

  @property
  def num_workers(self):
    """Processes that train (the chief, if a 'chief' job is listed, and the workers)."""
    return len(self.hosts)

  @property
  def worker_index(self):
    """This process's place among the workers (`hosts`): 0 for the chief, then 1, 2, ...

    It is TensorFlow's `id_in_cluster`: the replicas of worker w have the
    global replica ids w * num_gpus ... (w + 1) * num_gpus - 1.
    """
    return self.hosts.index(self.address)  # every host:port is listed once

  @property
  def is_chief(self):
    return self.worker_index == 0

  @property
  def address(self):
    """This worker's 'host:port'."""
    return self.jobs[self.task_type][self.task_id]

  def name(self):
    """'worker 1 of 2 (host:port)', for messages."""
    return f'worker {self.worker_index} of {self.num_workers} ({self.address})'

  def cluster_resolver(self, num_gpus=0):
    """A `tf.distribute.cluster_resolver.ClusterResolver` of this cluster.

    Args:
      num_gpus: int, GPUs of each worker to take a replica each; 0: one
        replica on the CPU (TensorFlow treats a machine's CPUs as one device).
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(self.jobs), task_type=self.task_type, task_id=self.task_id,
        rpc_layer='grpc', num_accelerators={'GPU': num_gpus})


def parse_worker_hosts(text, source='--worker_hosts'):
  """'h1:p1,h2:p2' -> ('h1:p1', 'h2:p2'), every item checked.

  Raises:
    ClusterError: an item is not host:port with a port in 1..65535, or a
      host:port is listed twice (in `source`, for the message).
  """
  hosts = tuple(item.strip() for item in text.split(',') if item.strip())
  if not hosts:
    raise ClusterError(f'{source} is empty; list the workers as host:port,host:port.')
  for host in hosts:
    name, _, port = host.rpartition(':')
    if not (name and port.isdigit() and 1 <= int(port) <= 65535):
      raise ClusterError(f'{host!r} in {source} is not host:port (port 1..65535), '
                         'e.g. 10.0.0.1:2222.')
  if len(set(hosts)) != len(hosts):
    raise ClusterError(f"{source} lists a host:port twice: {','.join(hosts)}.")
  return hosts


def resolve_cluster(worker_hosts=(), task_index=0, environ=os.environ):
  """The cluster of a multiworker run, from --worker_hosts or TF_CONFIG.

  Args:
    worker_hosts: tuple of 'host:port', one per worker, the same list and
      order on every worker; empty to read TF_CONFIG.
    task_index: int, this worker's index in worker_hosts (0 is the chief).
    environ: mapping holding TF_CONFIG.

  Returns:
    Cluster.

  Raises:
    ClusterError: neither is given or both are, TF_CONFIG is malformed, or
      the task is not in the cluster.
  """
  text = environ.get(TF_CONFIG, '').strip()
  if worker_hosts:
    if text:
      raise ClusterError('TF_CONFIG is set and --worker_hosts is given: name the cluster '
                         'once. Unset TF_CONFIG (`unset TF_CONFIG`), or drop --worker_hosts '
                         'and --task_index.')
    if task_index not in range(len(worker_hosts)):
      raise ClusterError(f'--task_index {task_index} is not an index of the '
                         f'{len(worker_hosts)} --worker_hosts (0..{len(worker_hosts) - 1}).')
    return Cluster({'worker': tuple(worker_hosts)}, 'worker', task_index)
  if not text:
    raise ClusterError(f'--strategy multiworker needs the cluster: set TF_CONFIG (e.g. '
                       f'{_EXAMPLE}) or pass --worker_hosts and --task_index.')
  try:
    tf_config = json.loads(text)
    cluster, task = dict(tf_config['cluster']), tf_config['task']
    if set(cluster) - {'chief', 'worker'} or len(cluster.get('chief', ())) > 1:
      raise ValueError('its jobs are "worker" and one "chief" at most')
    # Every host:port of every job checked, none twice.
    parse_worker_hosts(','.join(sum(cluster.values(), [])), TF_CONFIG)
    jobs = {job: tuple(h.strip() for h in hosts if h.strip()) for job, hosts in cluster.items()}
    task_type, task_id = task['type'], task.get('index', 0)
    if not isinstance(task_id, int) or task_id not in range(len(jobs.get(task_type, ()))):
      raise ValueError('its task is not in its cluster')
  except (ValueError, TypeError, KeyError, AttributeError) as e:  # JSON errors are ValueErrors
    raise ClusterError('TF_CONFIG is not valid JSON of a "cluster" (lists of host:port) and a '
                       f'"task" in it ({type(e).__name__}: {e}): {text!r}. E.g. {_EXAMPLE}'
                       ) from None
  return Cluster(jobs, task_type, task_id, source=TF_CONFIG)


# --- the start-up -------------------------------------------------------------


def _split(address):
  host, _, port = address.rpartition(':')
  return host.strip('[]'), int(port)


def check_hosts(cluster):
  """Every worker's host name resolves, or StartupError names the first that does not.

  Raises:
    StartupError: getaddrinfo failed for this worker's host or a peer's.
  """
  for index, address in enumerate(cluster.hosts):
    host, port = _split(address)
    try:
      socket.getaddrinfo(host, port)
    except (socket.gaierror, UnicodeError) as e:
      raise StartupError(f'{cluster.name()}: cannot resolve {host!r}, the host of '
                         f'{_names(cluster, [index])}: {e}. Fix the name in {cluster.source} '
                         '(the same list on every worker), or use an IP address.') from None


def listen(cluster):
  """A socket listening on this worker's port: the proof that the port is free.

  It listens on all interfaces, as TensorFlow's gRPC server will (IPv6 and
  IPv4 on one socket where the machine has IPv6; SO_REUSEADDR, as gRPC: a
  port whose last connections are in TIME_WAIT is free), and answers the
  peers' hellos until `rendezvous` closes it.

  Returns:
    socket.socket, listening.

  Raises:
    StartupError: the port is taken, or not this user's to bind.
  """
  port = _split(cluster.address)[1]
  dual = socket.has_dualstack_ipv6()
  try:
    return socket.create_server(('', port), family=socket.AF_INET6 if dual else socket.AF_INET,
                                dualstack_ipv6=dual)
  except OSError as e:
    raise StartupError(f'{cluster.name()}: port {port} is not free on this machine '
                       f'({e.strerror or e}). Stop the process that listens on it, or give '
                       f'this worker another port in {cluster.source} (the same list on every '
                       'worker).') from None


def _exchange(cluster, sock, expected=None):
  """Says this worker's hello on `sock`, reads the peer's: the peer's worker index.

  A hello is one JSON line: [HELLO, worker index, host list]. None when the
  other end is not a worker of this program (another program, or a worker
  already past the start-up: TensorFlow's server on its port).

  Args:
    cluster: Cluster.
    sock: a connected socket.
    expected: int, the worker index listed at the address we connected to;
      None for a peer that connected to us.

  Raises:
    StartupError: the peer was started with another cluster or index.
  """
  sock.sendall(f'{json.dumps([HELLO, cluster.worker_index, cluster.hosts])}\n'.encode())
  try:
    word, index, hosts = json.loads(sock.makefile('rb').readline(65536))
  except (ValueError, TypeError):  # UnicodeError is a ValueError
    return None
  if word != HELLO or not isinstance(hosts, list) or type(index) is not int or not (
      0 <= index < len(hosts)):
    return None
  where = cluster.hosts[expected] if expected is not None else hosts[index]
  if hosts != list(cluster.hosts) or expected not in (None, index) or (
      index == cluster.worker_index):
    raise StartupError(f"{cluster.name()}: the worker at {where} was started as worker {index} "
                       f"of {','.join(map(str, hosts))}. Start every worker with the same "
                       f"{cluster.source} list, each with the index of its own host:port.")
  return index


def _say_hello(cluster, index):
  """True once worker `index` answered our hello; StartupError on another cluster."""
  try:
    with socket.create_connection(_split(cluster.hosts[index]), timeout=CONNECT_SECS) as sock:
      return _exchange(cluster, sock, index) == index
  except OSError:  # refused, unreachable, timed out: not up yet
    return False


def rendezvous(cluster, listener, timeout):
  """Returns once every other worker has said hello; closes `listener`.

  Each worker calls it with its own listening socket (`listen`). A worker
  counts a peer as up once either of the two has answered the other's hello,
  so both learn it at the same moment, and none waits for one that moved on.
  Python code throughout: a signal stops it at once.

  Args:
    cluster: Cluster.
    listener: socket from `listen(cluster)`.
    timeout: seconds to wait for all (--startup_timeout).

  Raises:
    StartupError: a peer did not answer within `timeout` (the message names
      every one that did not), or one was started with another cluster.
  """
  seen, errors = set(), []  # the peers that said hello to us; StartupErrors for this thread

  def answer():
    # Answers the peers' hellos until the listener is closed: a hello from
    # worker j, answered, tells both that the other is up.
    while True:
      try:
        conn = listener.accept()[0]
      except socket.timeout:
        continue
      except OSError:
        return  # closed
      with conn:
        conn.settimeout(CONNECT_SECS)
        try:
          seen.add(_exchange(cluster, conn))
        except StartupError as e:
          errors.append(e)
        except OSError:
          pass  # a peer that went away mid-hello tries again

  listener.settimeout(0.2)
  thread = threading.Thread(target=answer, name='startup-hello', daemon=True)
  thread.start()
  try:
    pending = set(range(cluster.num_workers)) - {cluster.worker_index}
    if pending:
      logger.warning(f'{cluster.name()}: waiting up to {timeout} s (--startup_timeout) for '
                     f'{_names(cluster, pending)}.')
    deadline = time.monotonic() + timeout
    while True:
      if errors:
        raise errors[0]
      pending = {i for i in pending - seen if not _say_hello(cluster, i)}
      if not pending:
        return
      left = deadline - time.monotonic()
      if left <= 0:
        raise StartupError(
            f'{cluster.name()}: no answer from {_names(cluster, pending)} within {timeout} s '
            '(--startup_timeout). Start every worker within that time of the others, with '
            f'the same {cluster.source} list and each its own index, and check that their '
            'ports are reachable from here.')
      time.sleep(min(RETRY_SECS, left))
  finally:
    listener.close()  # which ends `answer`
    thread.join(timeout=2)


def _names(cluster, indices):
  """'host:port (worker i), ...' of the workers `indices`, for messages."""
  return ', '.join(f'{cluster.hosts[i]} (worker {i})' for i in sorted(indices))
