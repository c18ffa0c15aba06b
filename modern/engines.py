"""The engines the one training loop (`modern.train.train`) runs the step on.

  towers       (default) modern.step.TowerStep: one tf.function tower per device
               of the plan, the gradients averaged on the variables' device.
  mirrored     tf.distribute.MirroredStrategy over the plan's devices: one
               replica per device, the variables mirrored on every device,
               the gradients all-reduced on `devices.VARIABLE_DEVICE`.
  multiworker  tf.distribute.MultiWorkerMirroredStrategy: several worker
               processes (machines), each with one replica per GPU (or one on
               its CPU), the gradients all-reduced across every replica of
               every worker. The cluster comes from TF_CONFIG or from
               --worker_hosts and --task_index.

An engine is the modern trainer's side of `runtime.training.train_loop`
(`Towers`); it builds the step (`tower_step`) and runs it. Only `MultiWorker`,
where several processes train together, agrees with its peers: it broadcasts
the restored state, votes on a stop, meets at a final barrier and bounds
every wait. `ENGINES` picks the engine; the loop never asks which one it has.

The replica engines run the towers' update (`modern.step.TrainState`) on
every replica: no Keras optimizer, the same learning rate and moving averages.
Every step is synchronous, and the global batch is batch_size x replicas over
all workers.
"""

import contextlib
import faulthandler
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import tensorflow as tf

from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.modern import cluster as cluster_lib
from cifar10_towers.modern import inputs
from cifar10_towers.modern import step as step_lib
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import ending
from cifar10_towers.runtime import lock
from cifar10_towers.runtime import stderr_filter
from cifar10_towers.runtime import training

logger = logging.getLogger(__name__)


class Towers(training.Trainer):
  """One tf.function tower per device of the plan (modern.step.TowerStep).

  The towers engine, and the base of the others: the modern trainer's side
  of `runtime.training.train_loop`, on one process.

  Attributes:
    config: runtime.config.TrainConfig.
    plan: common.devices.DevicePlan of this process.
    tower_step: the step (set by `start`): modern.step.TowerStep or ReplicaStep.
    state: its modern.step.TrainState.
    saver: runtime.checkpoints.StepSaver of write_dir, made by
      modern.checkpoints.step_saver (set by modern.train.train).
    stop: the run's runtime.training.StopRequest (set by modern.train.train).
    num_workers, worker_index, chief: this process's place in the run.
    write_dir: where this process writes checkpoints and summaries.
    lock_what: what the train_dir lock says of this run.
  """

  num_workers = 1
  worker_index = 0
  lock_what = 'modern training'

  def __init__(self, config, plan):
    self.config = config
    self.plan = plan
    self.write_dir = self.train_dir = config.train_dir

  def strategy(self):
    """The tf.distribute.Strategy the step runs under; None: the towers' own step."""

  def build(self, decay_steps):
    """The step object (see `tower_step`)."""
    strategy = self.strategy()
    return (ReplicaStep if strategy else step_lib.TowerStep)(
        self.plan, decay_steps, jit=self.config.jit, optimizer=self.config.optimizer,
        strategy=strategy)

  def start(self, decay_steps):
    """Builds the step; with peers, meets them first. Nothing is written."""
    self.tower_step = self.build(decay_steps)
    self.state = self.tower_step.state
    self.images = self.config.batch_size * self.tower_step.num_towers

  def run(self, resume_from, on_step):
    """`runtime.training.train_loop` on this engine, from the state restored from
    `resume_from` (a path, or None); the global step reached.

    Raises:
      runtime.training.Stopped: the stop came before or during this run's
        first step, in a single process.
    """
    config, step = self.config, self.global_step()
    if resume_from:
      logger.info(f'Resuming from {resume_from} at global step {step}.')
      self.saver.last_saved = step
    if step >= config.max_steps:
      logger.warning(training.nothing_to_train(step, config.max_steps, config.train_dir))
      return step
    # A single process stops at once until its first step is done; with peers
    # a stop rides on the step's result instead, so that all stop after one step.
    with self.stop.raising() if self.alone else contextlib.nullcontext():
      # The training batches of this process (its shard of the records).
      self._iterator = iter(inputs.distorted_inputs(
          config.data_dir, config.batch_size, config.num_gpus, seed=config.seed,
          num_shards=self.num_workers, shard_index=self.worker_index))
    return training.train_loop(config, self.stop, self, step, on_step)

  def step(self, step, first, summaries):
    # The first step traces and compiles the step function and fills the
    # shuffle buffer: seconds, tens of seconds on a busy machine, with
    # nothing written yet, so a stop ends it at once. (With peers a stop
    # rides on the step's result instead, so that all stop after one step.)
    def progress(what):
      # During the first step, a heartbeat line saying `what` it waits for
      # past 5 s. Progress comes from the chief.
      return (training.heartbeat(lambda seconds: f'{what}... {seconds} s')
              if first and self.chief else contextlib.nullcontext())

    with self.stop.raising() if first and self.alone else contextlib.nullcontext():
      batches = self._iterator  # read inside the step (TowerStep.next_step)
      if first:
        with progress('Filling the shuffle buffer with '
                      f'{hparams.min_queue_examples(self.examples_per_worker)} examples'):
          # Read here, so that the wait says what it is; the step reads it from an
          # iterator of its own, of the same element spec: the same trace.
          batches = iter(tf.data.Dataset.from_tensors(next(self._iterator)))
      with progress('Building and tracing the step (first step)'):
        tower_losses, stopping = self.run_step(step, first, batches, summaries)
    self._summary_step = summaries  # the graph open_summaries writes
    return training.StepResult(tower_losses, stopping)

  def run_step(self, step, first, iterator, summaries):  # pylint: disable=unused-argument
    """The step on the next batch of `iterator`: (tower losses, numpy;
    whether every process stops now)."""
    self._summaries = self.tower_step.next_step(iterator, summaries)
    return self._summaries[0].numpy(), False

  def global_step(self):
    return int(self.state.global_step.numpy())

  def open_summaries(self):
    writer = tf.summary.create_file_writer(self.write_dir)
    try:
      with writer.as_default():
        tf.summary.graph(self.tower_step.step_graph(self._iterator, self._summary_step))
    except (tf.errors.OpError, OSError) as e:
      logger.warning(f'could not write the graph to TensorBoard summaries in {self.write_dir} '
                     f'({str(e).strip().splitlines()[0]}).')
    return writer

  def write_summaries(self, writer, step):
    self.tower_step.write_summaries(writer, tf.constant(step, tf.int64), *self._summaries)


class ReplicaStep(step_lib.TowerStep):
  """modern.step's step on the replicas of a tf.distribute strategy.

  The interface of modern.step.TowerStep (`state`, `num_towers`, `next_step`,
  `train_step`, `compute_gradients`). `tower_batches` = (images [N, B, 24, 24, 3],
  labels [N, B]) hold
  either one batch per replica of the whole run (N = num_towers, replica r
  takes images[r]; every worker passes the same N batches) or one per replica
  of this worker (N = plan.num_towers, local replica i takes images[i]).
  With one worker the two are the same. The step returns no summaries from
  inside it (`inner_summaries`).

  Attributes:
    strategy: the tf.distribute.Strategy.
    state: modern.step.TrainState, created under the strategy's scope.
    num_towers: int, replicas in sync over all workers (R).
  """

  inner_summaries = False

  def __init__(self, *args, **kwargs):
    """modern.step.TowerStep's arguments, `strategy` required."""
    super().__init__(*args, **kwargs)
    self.num_towers = self.grad_divisor = self.strategy.num_replicas_in_sync

  def _replica_step(self, images, labels):
    """In each replica: its gradients, then the all-reduce over every replica.

    Returns:
      (list of averaged gradients, identical on every replica;
       float32 [R]: every replica's loss).
    """
    context = tf.distribute.get_replica_context()
    # This replica's own copy of the variables (mirrored on its device).
    values = [var.read_value() for var in self.state.model.variable_list()]
    loss, grads, _ = self._tower_fn(values, images, labels)
    # Each replica's loss goes into its own slot of a vector (zeros elsewhere,
    # so the sum is exact); one all-reduce then gives every worker all R losses.
    report = tf.one_hot(context.replica_id_in_sync_group, self.num_towers, on_value=loss)
    # Synchronization point: every replica of every worker meets here. The
    # SUM over replicas of the gradients of loss_r / R is the towers' mean.
    with tf.name_scope('average_gradients'):
      reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, grads + [report])
    return reduced[:-1], reduced[-1]

  def _gradients(self, images, labels, summaries=False):
    """All-reduced gradients (per replica), tower losses [R] and no summaries."""
    # The replicas of worker w have the global ids w * L .. w * L + L - 1 (L
    # local replicas): local replica i of every worker takes batch i of local batches.
    count = images.shape[0]
    batches = self.strategy.experimental_distribute_values_from_function(
        lambda ctx: (images[ctx.replica_id_in_sync_group % count],
                     labels[ctx.replica_id_in_sync_group % count]))
    grads, report = self.strategy.run(self._replica_step, args=batches)
    # Identical on every replica after the all-reduce: take the first local one.
    return grads, self.strategy.experimental_local_results(report)[0], {}

  def _apply(self, grads):
    # --clip_where averaged: in every replica, on its identical averaged
    # gradients (clip_by_global_norm needs them all at once, which the
    # per-variable `update` does not give).
    if self.state.optimizer.clips_averaged:
      grads = self.strategy.run(lambda *g: self.state.clip_averaged(list(g)), args=tuple(grads))
    # Each replica's copy gets that replica's (identical) averaged gradient.
    self.state.apply_gradients(grads, update=self.strategy.extended.update)


@tf.function(autograph=False)
def broadcast_from_chief(strategy, state):
  """Sets every worker's variables, averages and global step (a modern.step.TrainState's)
  to the chief's."""
  # The optimizer's slots too: a resumed momentum or Adam run goes on from
  # the chief's.
  variables = [*state.model.variable_list(), *state.ema.variable_list(),
               *state.slots.values(), state.global_step]

  def replica_fn():
    context = tf.distribute.get_replica_context()
    # Replica 0 (the chief's first) sends its values, all others zeros: the
    # SUM is the chief's values, exactly. As float64, exact for float32 and
    # for the int64 step below 2**53: one all-reduce packs one dtype.
    return context.all_reduce(tf.distribute.ReduceOp.SUM, [
        tf.where(context.replica_id_in_sync_group == 0, x, tf.zeros_like(x))
        for x in (tf.cast(var.read_value(), tf.float64) for var in variables)])

  for var, value in zip(variables, strategy.run(replica_fn)):
    strategy.extended.update(var, lambda v, x: v.assign(tf.cast(x, v.dtype)), args=(value,))


@tf.function(autograph=False)
def all_sum(strategy, value):
  """The sum of `value` (float32 scalar) over every replica of every worker; returns when
  every replica has called it (with 1.0: a barrier)."""
  # (tf.identity: a copy on the replica's device, where the all-reduce takes it.)
  return strategy.experimental_local_results(strategy.run(
      lambda: tf.distribute.get_replica_context().all_reduce(
          tf.distribute.ReduceOp.SUM, tf.identity(value))))[0]


def mirrored_strategy(plan):
  """MirroredStrategy with one replica on each of the plan's devices.

  The gradients meet on the variables' device (`ReductionToOneDevice`), where
  the towers average theirs; NCCL would need GPUs.
  """
  return tf.distribute.MirroredStrategy(
      devices=list(plan.tower_devices),
      cross_device_ops=tf.distribute.ReductionToOneDevice(
          reduce_to_device=devices.VARIABLE_DEVICE))


class Mirrored(Towers):
  """tf.distribute.MirroredStrategy over the plan's devices."""

  def strategy(self):
    return mirrored_strategy(self.plan)


# The collective timeout is this many peer timeouts: a backstop behind the
# watchdog, which ends a wait first (see PeerWatchdog).
COLLECTIVE_TIMEOUT_FACTOR = 2
# TensorFlow's own start-up follows the rendezvous (modern.cluster), when every
# peer is up, and takes a second; it gets the start-up's time left, but at
# least this, before the worker gives up (see `_bounded`).
STARTUP_BACKSTOP_MIN_SECS = 10
_RESTART = ('Restart every worker with the same flags: they resume from the '
            'newest checkpoint in the chief\'s --train_dir.')


def multi_worker_strategy(plan, cluster, collective_timeout):
  """The stock MultiWorkerMirroredStrategy: a replica per GPU of the plan, else one on the CPU.

  Must be created before any other TensorFlow op runs in this process (it
  starts the process's gRPC server); returns once every worker has started.

  Args:
    plan: common.devices.DevicePlan, this worker's devices.
    cluster: modern.cluster.Cluster.
    collective_timeout: seconds a collective waits for its peers before it
      fails with DeadlineExceededError.
  """
  return tf.distribute.MultiWorkerMirroredStrategy(
      cluster_resolver=cluster.cluster_resolver(
          num_gpus=plan.num_towers if plan.kind == 'gpu' else 0),
      communication_options=tf.distribute.experimental.CommunicationOptions(
          implementation=tf.distribute.experimental.CommunicationImplementation.RING,
          timeout_seconds=float(collective_timeout)))


# Run by a child process while TensorFlow's start-up holds Python's lock: it
# says why the worker ended if faulthandler's timer (which runs without that
# lock) writes anything to its stdin, and nothing if its stdin just closes.
_SAY_WHY = 'import sys\nif sys.stdin.buffer.read(1):\n  sys.stderr.write(sys.argv[1])\n'


@contextlib.contextmanager
def _bounded(seconds, message):
  """Ends the process with status 1 and `message` on stderr if the block lasts `seconds`.

  For a block that holds Python's lock (no thread or signal handler runs):
  faulthandler's timer thread is C, and exits the process itself.
  """
  # A session of its own: a Ctrl-C (SIGINT to the terminal's process group)
  # must not end it with a KeyboardInterrupt traceback; it ends when its
  # stdin closes, however this process ends.
  child = subprocess.Popen([sys.executable, '-c', _SAY_WHY, f'{message}\n'],
                           stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                           stderr=stderr_filter.real_stderr(), start_new_session=True)
  try:
    with child.stdin:
      faulthandler.dump_traceback_later(seconds, exit=True, file=child.stdin)
      try:
        yield
      finally:
        faulthandler.cancel_dump_traceback_later()
  finally:
    child.wait()


class MultiWorker(Mirrored):
  """tf.distribute.MultiWorkerMirroredStrategy, this process one of the workers.

  The chief (task 0, or the 'chief' task of TF_CONFIG) locks train_dir,
  restores, writes checkpoints and summaries there and prints progress; every
  other worker locks and writes to `<train_dir>/workertemp_<id>` (TensorFlow's
  multi-worker convention: all workers save, only the chief's copy is kept),
  removes it when it ends, and prints only warnings and errors.

  The workers meet in Python before TensorFlow's start-up (`modern.cluster`),
  because TensorFlow's own wait for them cannot be interrupted. After it,
  every wait for the peers (the first broadcast, each step, the final
  barrier) is watched (`PeerWatchdog`).
  """

  # What a collective raises when a peer is gone: UnavailableError (the peer's
  # process is dead or unreachable), DeadlineExceededError (the collective
  # timeout), and the aborts that follow either.
  peer_errors = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                 tf.errors.CancelledError, tf.errors.AbortedError)

  def __init__(self, config, plan):
    super().__init__(config, plan)
    cluster = self.cluster = cluster_lib.resolve_cluster(config.worker_hosts, config.task_index)
    self.num_workers = cluster.num_workers
    self.worker_index = cluster.worker_index
    self.chief = cluster.is_chief
    self.alone = False
    self.lock_what = f'multiworker training as {cluster.name()}'
    if not self.chief:  # TensorFlow's convention for a non-chief's copy
      self.write_dir = os.path.join(config.train_dir, f'workertemp_{self.worker_index}')

  def __exit__(self, *exc):
    if not self.chief:  # the chief's copy is the one kept
      shutil.rmtree(self.write_dir, ignore_errors=True)

  def strategy(self):
    return multi_worker_strategy(self.plan, self.cluster,
                                 COLLECTIVE_TIMEOUT_FACTOR * self.config.peer_timeout)

  def start(self, decay_steps):
    """Meets the other workers, then starts TensorFlow's engine on this one.

    Raises:
      modern.cluster.StartupError: a host name does not resolve, this worker's
        port is taken, a peer did not answer within --startup_timeout or was
        started with another cluster, or TensorFlow's start-up failed.
    """
    cluster, config = self.cluster, self.config
    started = time.monotonic()
    if not self.chief:  # left over in its locked write_dir only if a run was killed
      for entry in os.scandir(self.write_dir):
        if entry.is_dir(follow_symlinks=False):
          shutil.rmtree(entry.path, ignore_errors=True)
        elif entry.name != lock.LOCK_FILE:
          os.remove(entry.path)
    cluster_lib.check_hosts(cluster)
    cluster_lib.rendezvous(cluster, cluster_lib.listen(cluster),
                           config.startup_timeout)
    seconds = max(STARTUP_BACKSTOP_MIN_SECS,
                  config.startup_timeout - (time.monotonic() - started))
    # TensorFlow's start-up has no deadline of its own and installs its own
    # SIGTERM handler (the preemption notifier, unused here): bound it, and
    # give SIGTERM back to Python's handler (the StopRequest's) afterwards.
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
      with _bounded(seconds, f"Error: {cluster.name()}: every worker said hello, but "
                    f"TensorFlow's start-up did not finish within {seconds:.0f} s "
                    "(--startup_timeout): a worker failed or was stopped while "
                    "starting (see its output). Start every worker again."):
        super().start(decay_steps)
    except tf.errors.OpError as e:
      # e.g. 'Could not start gRPC server': another process took the port
      # after the rendezvous found it free.
      raise cluster_lib.StartupError(
          f"{cluster.name()}: TensorFlow's start-up failed ({_quote(e)}). Start every worker "
          "again with the same flags, or, if this worker's port was taken meanwhile, "
          f"another in {cluster.source}.") from None
    finally:
      if sigterm is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, sigterm)

  def _save_completed(self, step, first_step):
    """The chief saves the last step completed in this run, if any: its path, or None."""
    if not self.chief or step <= first_step:
      return None
    try:
      # A failed step may have incremented the global step before its
      # all-reduce failed (the increment does not depend on it).
      self.state.global_step.assign(step)
      return self.saver()
    except (checkpoints.CheckpointError, lock.LockError, tf.errors.OpError,
            OSError):  # LockError: train_dir was removed under the run
      return None

  def run(self, resume_from, on_step):
    """Every worker takes the chief's state, then trains; waits for the peers are watched."""
    self._watchdog = PeerWatchdog(self.cluster, self._save_completed, self.__exit__)
    try:
      # A stop request while the main thread waits for the peers in C++: the
      # watchdog ends that wait if it goes on.
      with self.stop.while_blocked(self._watchdog.stop_requested):
        step = self.global_step()
        try:
          # Synchronization point: every worker takes the chief's state (fresh or
          # restored), so all resume from the chief's checkpoint.
          with self.waiting('the start-up', step, first=True):
            broadcast_from_chief(self.tower_step.strategy, self.state)
        except self.peer_errors as e:
          return self.failed(e, step, step, self.stop)  # nothing to save
        return super().run(resume_from, on_step)
    finally:
      self._watchdog.stop()

  def waiting(self, what, step, first=False):
    """Context for one wait for the peers (`what`) after global step `step`."""
    config = self.config
    flag = ('startup_timeout' if first and config.startup_timeout > config.peer_timeout
            else 'peer_timeout')
    return self._watchdog.guard(getattr(config, flag), what, step, f'--{flag}')

  def run_step(self, step, first, iterator, summaries):
    with self.waiting('the step', step, first=first):
      tower_losses, _ = super().run_step(step, first, iterator, summaries)
      # A stop request of any worker stops all after this step: the stop vote.
      return tower_losses, bool(all_sum(self.tower_step.strategy,
                                        tf.constant(float(self.stop.requested))) > 0)

  def finish(self, step):
    # Synchronization point: no worker leaves before all have saved.
    with self.waiting('the final barrier', step):
      all_sum(self.tower_step.strategy, tf.constant(1.0))

  def failed(self, error, first_step, step, stop):
    """After a wait for the peers failed in this thread: saves what it can, says so.

    Returns:
      int, the global step, when a stop request (signal) of this worker ended
      the wait: the run stopped.

    Raises:
      runtime.training.TrainingError: the peers were lost; else as the base's.
    """
    if not isinstance(error, self.peer_errors):
      return super().failed(error, first_step, step, stop)
    saved = self._save_completed(step, first_step)
    if stop.requested:
      # (Not lower(): that would change the path's case.)
      logger.warning(_line(self.cluster, step, saved, 'while waiting for the other workers',
                           stop.signal_name))
      return step
    raise training.TrainingError(_line(self.cluster, step, saved, _quote(error))) from error

  def report_stop(self, signal_name, step, path):
    # A non-chief's own copy is removed at the end: the chief's is the one kept.
    path = os.path.join(self.config.train_dir, os.path.basename(path))
    # No signal of this process: a stop request of another worker rode on the step.
    line = (f"{self.cluster.name()}: stopped by "
            f"{signal_name or 'a stop request of another worker'} at global step {step}; "
            f"{'it' if self.chief else 'the chief'} saved {path}.")
    if not signal_name:
      # Not a signal of this process, so not its exit status: the run did not
      # end, and every worker must be started again.
      raise training.TrainingError(f'{line} {_RESTART}')
    # The run's one ending line, on stderr (runtime.ending).
    ending.say(training.stopped_line(signal_name, step, path) if self.chief else line)


def _quote(error):
  """'UnavailableError: <the line of `error` naming the cause>', for messages.

  The first line that names it, with the next (the unhealthy tasks) after a
  ':'; else the first line.
  """
  text = str(error).strip()
  cause = re.search(r'.*(aborted by|unhealthy|Deadline|onnect)(.*:\s*\n.*|.*)', text)
  return f"{type(error).__name__}: {' '.join((cause or re.match('.*', text)).group().split())}"


def _line(cluster, step, saved, why, stopped_by=None):
  """A worker's line when it lost its peers, or was stopped (by `stopped_by`) waiting for them."""
  return (f"{cluster.name()}: {f'stopped by {stopped_by}' if stopped_by else 'lost its peers'}"
          f" at global step {step} ({why}); "
          f"{f'saved {saved}.' if saved else 'this worker saved no checkpoint.'} {_RESTART}")


class PeerWatchdog(threading.Thread):
  """Ends a wait for the peers that lasts too long, or that a stop cuts short.

  The guarded blocks are the waits for the peers (the first broadcast, each
  step, the final barrier), where the main thread waits in C++ with Python's
  lock released. This thread watches them: past a block's deadline (the peer
  timeout), or STOP_GRACE_SECS into a block after a stop request (SIGINT,
  SIGTERM: `stop_requested`, the StopRequest's `while_blocked` callback), it
  saves the last step completed (`save_completed`: the update of a step
  waits for its all-reduce, so the variables hold that step's values), says
  so, runs `cleanup` and ends the process: status 1, or 128 + the signal's
  number (os._exit: the main thread is stuck in C++, and TensorFlow offers no
  public way to abort a collective that waits).

  Our own code, not TensorFlow's (TF 2.21): a Python signal handler cannot
  run while the main thread waits in a collective, so a stop during such a
  wait needs this thread (tests/test_faults_multiworker.py, 'SIGTERM while a
  peer hangs'); and TensorFlow's collective timeout, which ends a wait for a
  frozen peer too, later, sometimes crashes the process on CPU (SIGABRT,
  SIGSEGV) when it fires, which leaves the user without a message
  (tests/test_distributed_multiworker.py, the 'frozen' peer).
  """

  POLL_SECS = 0.25
  STOP_GRACE_SECS = 2.0  # a step or barrier still waiting this long after a stop is hung
  STOP_LIMIT_SECS = 6.0  # after a stop, no wait goes on past this

  def __init__(self, cluster, save_completed, cleanup,
               exit=ending.exit_now):  # pylint: disable=redefined-builtin
    super().__init__(name='peer-watchdog', daemon=True)
    self._cluster = cluster
    self._save_completed = save_completed
    self._cleanup = cleanup
    self._exit = exit
    # Each read or written whole (the GIL makes that atomic): no lock.
    self._block = None  # (start, deadline, what, step, flag) of the guarded wait
    self._stop_request = None  # (time, signal name) of the first stop request
    self._first_step = None
    self._done = threading.Event()
    self.start()

  @contextlib.contextmanager
  def guard(self, seconds, what, step, flag):
    """The block waits for the peers at most `seconds` (the value of `flag`)."""
    if self._first_step is None:
      self._first_step = step
    start = time.monotonic()
    self._block = (start, start + seconds, what, step, flag)
    try:
      yield
    finally:
      self._block = None

  def stop_requested(self, signal_name):
    """A stop request came (a stop signal): waits for the peers end soon."""
    self._stop_request = self._stop_request or (time.monotonic(), signal_name)

  def stop(self):
    self._done.set()
    self.join()

  def run(self):
    while not self._done.wait(self.POLL_SECS):
      block, now = self._block, time.monotonic()
      since, signal_name = self._stop_request or (None, None)
      if block is None:
        continue
      start, deadline, what, step, flag = block
      stopped = since is not None and now > min(max(start, since) + self.STOP_GRACE_SECS,
                                                since + self.STOP_LIMIT_SECS)
      if not stopped and now <= deadline:
        continue
      # The exit must come whatever fails on the way: the main thread is stuck.
      try:
        try:
          saved = self._save_completed(step, self._first_step)
        except Exception:  # pylint: disable=broad-except
          saved = None
        logger.warning(_line(
            self._cluster, step, saved, f'ending {what} after {now - max(start, since):.0f} s '
            'of waiting for the other workers', signal_name) if stopped else 'Error: ' + _line(
                self._cluster, step, saved, f'no answer in {what} within '
                f'{deadline - start:.0f} s ({flag}): a worker stopped, hung or is unreachable'))
        self._cleanup()
      finally:
        self._exit(training.exit_status(signal_name) if stopped else 1)
      return


# The engine of each config.strategy: ENGINES[config.strategy](config, plan) makes it
# (nothing started: see Towers.start).
ENGINES = {'towers': Towers, 'mirrored': Mirrored, 'multiworker': MultiWorker}
