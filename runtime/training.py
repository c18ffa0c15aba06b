"""Run-time pieces both training loops share: the log line and its averages,
progress lines during long waits, stop requests, divergence."""

import contextlib
import datetime
import logging
import math
import signal
import socket
import sys
import threading
import time
import typing

from cifar10_towers.common import errors
from cifar10_towers.common import hparams
from cifar10_towers.common import prog
from cifar10_towers.runtime import ending
from cifar10_towers.runtime import lock
from cifar10_towers.runtime import progress

logger = logging.getLogger(__name__)


class TrainingError(errors.Failure):
  """Training cannot go on; the message names the step and what to do."""


def log_line(step, loss, examples_per_sec, sec_per_batch, max_steps=None):
  """Upstream's progress line, and how far the run is.

  Args:
    step: int, global step just finished.
    loss: float, mean of the towers' total losses at that step.
    examples_per_sec: float, images of all towers per second.
    sec_per_batch: float, seconds per step.
    max_steps: optional int, where the run ends: adds `step/max_steps` and
      the time left at sec_per_batch.
  """
  line = (f'{datetime.datetime.now()}: step {step}, loss = {loss:.2f} ({examples_per_sec:.1f} '
          f'examples/sec; {sec_per_batch:.3f} sec/batch)')
  if max_steps:
    # Deviation from upstream: the line also says how far the run is.
    left = datetime.timedelta(seconds=round(max(0, max_steps - step) * sec_per_batch))
    line += f' {step}/{max_steps}, {left} left'
  return line


class LogWindow:
  """examples/sec and sec/batch of a log line: the mean over the steps since the last one.

  Each trainer adds every step's own seconds (the step itself, reading its
  batch: the session run, or the traced step), so the time spent writing
  summaries and checkpoints and printing between steps never counts. Steps
  marked `extra` do more than train (the run's first step, which traces the
  step and fills the input's shuffle queue or buffer; a step that also
  computes the summaries) and count only when the window holds nothing else,
  so that every line has a figure and a quiet run's figures are its steady
  speed. Both trainers use it the same way.
  """

  def __init__(self):
    self._steps = ([], [])  # (seconds, images) of the plain steps, of the extra ones

  def add(self, seconds, images, extra=False):
    """One step: its wall seconds and the images it trained on (all towers)."""
    self._steps[extra].append((seconds, images))

  def rates(self):
    """(examples/sec, sec/batch) of the window; (0, 0) when empty."""
    steps = self._steps[0] or self._steps[1]
    seconds = sum(s for s, _ in steps)
    if seconds <= 0:
      return 0.0, 0.0
    return sum(i for _, i in steps) / seconds, seconds / len(steps)

  def line(self, step, loss, max_steps=None):
    """`log_line` with the window's means; starts the next window."""
    rates = self.rates()  # (examples/sec, sec/batch)
    self.__init__()
    return log_line(step, loss, *rates, max_steps)


class StepResult(typing.NamedTuple):
  """What one step of a trainer gives `train_loop`."""

  tower_losses: typing.Sequence[float]  # each tower's total loss at the step
  stop: bool = False  # every process stops after this step (a stop request of one rode on it)


class Trainer(contextlib.AbstractContextManager):
  """A trainer's side of `train_loop` (legacy.train.QueueTrainer, modern.engines.Towers).

  A context manager (entered: itself, as every contextlib.AbstractContextManager).

  Attributes:
    images: int, the images of one step over all replicas.
    write_dir: str, where this process writes checkpoints and summaries.
    train_dir: str, where the run's checkpoints are kept.
    chief: bool, this process logs and reports (with peers, the chief alone).
    alone: bool, no peers: a stop ends the run at the next step boundary;
      with peers it rides on a step (`StepResult.stop`), so that all stop after one step.
    saver: runtime.checkpoints.StepSaver of write_dir: saves the current
      global step (unless saved already) and knows the step last saved.
  """

  chief = alone = True

  def __exit__(self, *exc):
    """After the run, however it ended (modern: its train_dir lock released)."""

  def step(self, step, first, summaries):
    """Runs one step from global step `step` (`summaries`: computes them too):
    a StepResult, or None when a stop cut it short before it ran."""
    raise NotImplementedError

  def global_step(self):
    """The global step the variables hold now."""
    raise NotImplementedError

  def open_summaries(self):
    """The summary writer (with a close()), opened after the first step: a stop before it
    writes nothing."""
    raise NotImplementedError

  def write_summaries(self, writer, step):
    """Writes the summaries of the last step (global step `step` reached)."""
    raise NotImplementedError

  def finish(self, step):
    """After the final save (with peers: the final barrier)."""

  def close(self):
    """After the loop, however it ended; may raise what ended it (an input thread's error)."""

  def failed(self, error, first_step, step, stop):  # pylint: disable=unused-argument
    """`error` crossed the loop after global step `step`: raises what the run ends with
    (`ending.failed`), or returns the step reached."""
    raise ending.failed(error, first_step, step, self, self.train_dir) from error

  def report_stop(self, signal_name, step, path):
    """Says how the run ended after a stop request (on stderr)."""
    ending.say(stopped_line(signal_name, step, path))


def train_loop(config, stop, trainer, step, on_step=None):
  """Both trainers' steps, from global step `step` until max_steps or a stop.

  Logs upstream's line every log_every steps (LogWindow's means), writes
  summaries every summary_every steps and a checkpoint every save_every, and
  at the end. It is the one ending path of a training run (docs/ending.md):
  a stop request (`stop`, an entered StopRequest) ends the loop at the next
  step boundary with a checkpoint of that step; whatever fails goes through
  `ending.failed`, which keeps the last completed step where it can.

  Args:
    config: runtime.config.TrainConfig.
    stop: StopRequest.
    trainer: Trainer.
    step: int, the global step the run starts from (< config.max_steps).
    on_step: optional callable(step, seconds, images) after every step (bench
      paces itself with it).

  Returns:
    int, the global step reached.

  Raises:
    Stopped: the stop came before this run's first step.
  """
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from cifar10_towers.runtime import checkpoints  # pylint: disable=import-outside-toplevel
  first_step, window, writer, stopping = step, LogWindow(), None, False
  write_errors = (RuntimeError, OSError, tf.errors.OpError)  # e.g. disk full
  try:
    try:
      while step < config.max_steps and not stopping and not (trainer.alone and stop.requested):
        first = step == first_step
        write_summary = (step + 1) % config.summary_every == 0
        start = time.monotonic()
        done = trainer.step(step, first, write_summary)
        if done is None:  # the stop closed the input under this step: it did not run
          break
        tower_losses, stopping = done
        seconds = time.monotonic() - start
        # Before `step` counts it: a diverged step is never saved.
        check_divergence(step + 1, tower_losses)
        # Deviation from upstream: 'step N' and model.ckpt-N count the global step after the update.
        step += 1  # each step moves global_step by one
        if writer is None:  # not before: a stop before the first step writes nothing
          writer = trainer.open_summaries()
        # Deviation from upstream: the loss logged is the mean over towers, not the last tower's.
        # Deviation from upstream: examples/sec and sec/batch are means over the
        # steps since the last line, not divided by the towers (LogWindow).
        window.add(seconds, trainer.images, first or write_summary)
        if step % config.log_every == 0 and trainer.chief:
          logger.info(window.line(step, sum(tower_losses) / len(tower_losses), config.max_steps),
                      extra=progress.IN_PLACE)
        if on_step:
          on_step(step, seconds, trainer.images)
        if write_summary:
          try:
            trainer.write_summaries(writer, step)
          except write_errors as e:
            raise checkpoints.write_failed(trainer.write_dir, 'TensorBoard summaries', e) from e
        if step % config.save_every == 0:
          trainer.saver()
      if step == first_step:
        raise Stopped(stop.signal_name)
      path = trainer.saver()  # with peers every worker saves: the chief's copy is kept
      trainer.finish(step)
    finally:
      try:
        trainer.close()
      finally:
        try:
          if writer is not None:
            writer.close()
        except write_errors as e:
          logger.warning(f'could not write the last TensorBoard summaries to {trainer.write_dir} '
                         f'({str(e).strip().splitlines()[0]}).')
  except Exception as e:  # pylint: disable=broad-except
    # The one ending path of a failure, whatever it was: keep the last
    # completed step if the variables still hold it, and say so in one line.
    return trainer.failed(e, first_step, step, stop)
  if stopping or (trainer.alone and stop.requested):  # a stop during the last save too
    trainer.report_stop(stop.signal_name, step, path)
  elif trainer.chief:
    logger.info(f'Done: the newest checkpoint is {path}. Evaluate it: ' + prog.command(
        'eval --run_once', checkpoint_dir=config.train_dir, data_dir=config.data_dir))
  return step


# Long waits (the first step: the shuffle queue or buffer filling, the step
# being traced) say what they are doing after this many seconds, then again
# every HEARTBEAT_EVERY; a wait shorter than that prints nothing.
HEARTBEAT_AFTER = 5.0
HEARTBEAT_EVERY = 10.0


@contextlib.contextmanager
def heartbeat(message):
  """A context: while its block runs past HEARTBEAT_AFTER seconds, one line every HEARTBEAT_EVERY.

  The lines come from a thread of its own, as the main thread is inside
  TensorFlow. `message(seconds)` makes each line (logged as progress) from the
  seconds waited so far; an exception in it (e.g. a session closed under a
  stop) ends the heartbeat quietly.
  """
  done = threading.Event()

  def beat():
    start, wait = time.monotonic(), HEARTBEAT_AFTER
    while not done.wait(wait):
      try:
        logger.info(message(int(time.monotonic() - start)))
      except Exception:  # pylint: disable=broad-except
        return
      wait = HEARTBEAT_EVERY

  thread = threading.Thread(target=beat, name='heartbeat', daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()
    thread.join()


# What a tower's loss can be: its batch's mean cross-entropy plus the weight
# decay of local3 and local4 (0.004 * sum(w**2) / 2 each). A fresh model
# predicts nearly uniformly (softmax_linear's weights have stddev 1/192), so
# its cross-entropy is ln(10) = 2.30; its weight decay is the expectation over
# the truncated-normal initial weights (stddev 0.04, cut at 2 stddevs, which
# keeps 0.774 of the variance): 0.002 * 0.774 * 0.04**2 * (2304*384 + 384*192)
# = 2.37. So a run starts at ~4.68, the loss both trainers log at step 1.
_TRUNCATED_NORMAL_VARIANCE = 0.7737  # variance / stddev**2, cut at 2 stddevs
INITIAL_LOSS = math.log(10) + 0.004 / 2 * _TRUNCATED_NORMAL_VARIANCE * (
    0.04 ** 2 * (2304 * 384 + 384 * 192))
# Training lowers it from there: healthy runs at upstream's learning rate stay
# under 3 times INITIAL_LOSS even at batches of 2 (the worst step of 3600
# measured: 12.8). 100 times INITIAL_LOSS needs the true class's logit ~460
# below another one, or local3/local4 weights 14 times their initial norm: the
# model has diverged, though its loss may stay finite for thousands of steps
# (weight decay shrinks weights of 1e17, a loss of 1e34, by 0.04% a step).
# Divergent runs grow by orders of magnitude a step (30, 1.4e4, 1.2e7, ...),
# so a tighter bound would catch them at most a step or two sooner.
DIVERGED_LOSS = 100 * INITIAL_LOSS  # ~468


def check_divergence(step, tower_losses):
  """Raises TrainingError naming the step and tower whose loss diverged.

  A loss diverged when it is NaN, infinite, or above DIVERGED_LOSS (see
  above). Call it before anything of the step is saved.

  Args:
    step: int, the global step just taken.
    tower_losses: the towers' total losses at that step, floats.
  """
  for i, value in enumerate(map(float, tower_losses)):
    if math.isfinite(value) and value <= DIVERGED_LOSS:
      continue
    bound = (f' (above {DIVERGED_LOSS:.0f}, 100 times a fresh model\'s loss of '
             f'{INITIAL_LOSS:.2f})' if math.isfinite(value) else '')
    raise TrainingError(
        f'Model diverged with loss = {value:.4g} at step {step} in tower {i}{bound}; the last '
        'good checkpoint is kept. Lower the learning rate or check the input data.')


def checked_decay_steps(examples_per_epoch, batch_size, num_replicas):
  """`hparams.decay_steps`, refused when it is 0 (the staircase would divide by it).

  Args:
    examples_per_epoch: int, training records present.
    batch_size: int, images per tower.
    num_replicas: int, towers over all workers.

  Returns:
    int >= 1.

  Raises:
    TrainingError: too few examples for this batch size and replica count.
  """
  decay_steps = hparams.decay_steps(examples_per_epoch, batch_size, num_replicas)
  if decay_steps < 1:
    raise TrainingError(
        f'decay_steps = int({examples_per_epoch} examples / {batch_size} batch / {num_replicas} '
        f'towers * {hparams.NUM_EPOCHS_PER_DECAY:g} epochs) = 0: too few training examples for '
        'this batch size. Use more data or a smaller --batch_size.')
  return decay_steps


@contextlib.contextmanager
def starting(config, num_replicas, write_dir, what):
  """Both trainers' start: a StopRequest, the epoch size and decay_steps, write_dir locked.

  Args:
    config: runtime.config.TrainConfig.
    num_replicas: int, towers over all workers.
    write_dir: str, the directory this process writes; `what` names the run in its lock.

  Yields:
    (stop, examples_per_epoch, decay_steps): the entered StopRequest, the
    training records present, `checked_decay_steps`.
  """
  from cifar10_towers.common import cifar10_format as fmt  # pylint: disable=import-outside-toplevel
  with StopRequest() as stop:
    # Until the first step nothing is written: a stop ends the run at once.
    with stop.raising():
      # Deviation from upstream: the epoch size is what is on disk, not 50000.
      examples_per_epoch = fmt.num_examples(fmt.train_files(config.data_dir))
      # All replicas of all workers count, as upstream's num_gpus counted its towers.
      decay_steps = checked_decay_steps(examples_per_epoch, config.batch_size, num_replicas)
    # Deviation from upstream: train_dir is never deleted; training resumes.
    # One run at a time: a second one would write the same steps and
    # overwrite the first's checkpoints. The lock creates the dir if missing.
    with lock.exclusive(write_dir, what=what):
      yield stop, examples_per_epoch, decay_steps


def stopped_line(signal_name, step, path):
  """The ending line of a run a stop request ended after saving `path`."""
  return (f'Stopped by {signal_name} at global step {step}; saved {path}. The same command '
          'resumes from it.')


def nothing_to_train(step, max_steps, train_dir):
  """The line of a run whose train_dir already holds max_steps steps."""
  return (f'Global step {step} in {train_dir} already reached max_steps {max_steps}; nothing to '
          'train (--max_steps counts from step 0, not from the resumed step: pass a larger one '
          'to train on).')


class Stopped(BaseException):
  """A stop request ended the run before its first step: nothing was written.

  Raised by `StopRequest.raising` blocks (and by the trainers when the stop
  came while their first step waited for input). A BaseException, like
  KeyboardInterrupt, so that no `except Exception` on the way swallows it.
  str() is the line to print.
  """

  def __init__(self, signal_name):
    super().__init__(f'Stopped by {signal_name} before the first step; nothing was saved.')
    self.signal_name = signal_name


# The signals that ask a run to stop (docs/ending.md): Ctrl-C and Ctrl-\ at a
# terminal (INT, QUIT), the terminal closing (HUP), a scheduler's stop (TERM)
# or its warning before a time limit (USR1, USR2: Slurm's --signal, PBS), a
# timer (ALRM), a CPU-time limit (XCPU), a power failure (PWR). A signal that
# was ignored when the process started (nohup, a background job) stays
# ignored. Crash signals (SEGV, BUS, ILL, FPE, ABRT) and SIGKILL are not
# among them: there the last periodic checkpoint is what remains.
STOP_SIGNALS = tuple(getattr(signal, name) for name in (
    'SIGHUP', 'SIGINT', 'SIGQUIT', 'SIGTERM', 'SIGUSR1', 'SIGUSR2', 'SIGALRM',
    'SIGXCPU', 'SIGPWR') if hasattr(signal, name))


class StopRequest(threading.Event):
  """A stop signal (STOP_SIGNALS) as a request to stop: a flag at step boundaries,
  and at once where blocked.

  Use as a context manager around everything a signal should stop cleanly. The
  loop checks `requested` at each step boundary and stops there with a
  checkpoint. An Event, set once a signal asked to stop: `wait(timeout)`
  sleeps up to `timeout` seconds, waking early on a stop (True if one came).

  Python runs a signal handler in the main thread only, between two bytecodes,
  so a main thread blocked inside TensorFlow (a queue still filling, a
  collective waiting for a peer that never comes) would not see a signal until
  that call returns, possibly never. So the handler also wakes a watcher thread
  (`signal.set_wakeup_fd`), which at once runs the callback of the blocking
  phase in progress (`while_blocked`): close the input queues, end a start-up
  that waits for peers, and so on.

  A second signal while stopping ends the process at once, with 128 + the
  signal's number and a line saying that the steps since the last checkpoint
  are lost.

  Before a run's first step nothing is written that a stop would have to
  save, so there (`raising`) a stop ends the run at once: the handler raises
  `Stopped` in the main thread, as Ctrl-C raises KeyboardInterrupt.

  Re-entrant: the CLI holds one for a whole command, so a signal during data
  checks or graph building is a stop request too; a trainer's own
  `with StopRequest()` inside it shares the same request. Outside the main
  thread it installs nothing.
  """

  _active = None  # the outermost entered StopRequest, or None

  def __init__(self):
    super().__init__()
    self.lock = threading.Lock()  # of `callbacks`, held while they run
    self.signal_name = None  # the signal's name ('SIGINT', ...) once requested
    self.callbacks = []  # while_blocked callbacks, innermost last
    self.raising_depth = 0  # depth of `raising` blocks (main thread only)
    self._raised = False  # a `raising` block has raised Stopped
    self._undo = contextlib.ExitStack()  # what `__exit__` undoes of `__enter__`

  def __enter__(self):
    if StopRequest._active:
      return StopRequest._active  # nested: share the outer request
    if threading.current_thread() is threading.main_thread():
      reader, writer = socket.socketpair()
      writer.setblocking(False)
      watcher = threading.Thread(target=self._watch, args=(reader,), name='stop-request',
                                 daemon=True)
      # Undone last first: the wakeup fd and the handlers as they were; then the
      # writer closed, the watcher's recv returns b'' and it ends.
      self._undo.callback(reader.close)
      self._undo.callback(watcher.join, timeout=5)
      self._undo.callback(writer.close)
      for sig in STOP_SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:  # nohup: it stays ignored
          # None: a handler not set from Python, i.e. the default.
          previous = signal.signal(sig, self._handle) or signal.SIG_DFL
          self._undo.callback(signal.signal, sig, previous)
      self._undo.callback(signal.set_wakeup_fd, signal.set_wakeup_fd(
          writer.fileno(), warn_on_full_buffer=False))
      # C code that cannot raise (TensorFlow's nest, while tracing) prints the
      # handler's Stopped, or CPython's SystemError from it, as an ignored
      # exception: a traceback for a stop that the ending path says in one line.
      hook = sys.unraisablehook
      self._undo.callback(setattr, sys, 'unraisablehook', hook)
      sys.unraisablehook = lambda info: (self._raised and _stops(info.exc_value)) or hook(info)
      watcher.start()
    StopRequest._active = self
    return self

  def __exit__(self, *exc):
    if StopRequest._active is self:
      StopRequest._active = None
      self._undo.close()

  @property
  def requested(self):
    """True once a signal asked to stop."""
    return self.is_set()

  @contextlib.contextmanager
  def while_blocked(self, callback):
    """Runs `callback(signal_name)` at once if a stop comes during the block.

    For a block where the main thread may wait inside TensorFlow for long
    (longer than a scheduler's grace period): the callback runs on a
    thread of the watcher while the main thread still waits, and must make that
    wait end (close a queue) or end the process itself (os._exit after a
    message). If a stop was requested before the block, the callback runs
    here first, in the calling thread. The callback never outlives the
    block: leaving it waits for a callback still running, so the callback
    may use what the block's owner closes after the block (a Session).
    """
    with self.lock:
      if self.requested:
        _run_callback(callback, self.signal_name)
      self.callbacks.append(callback)
    try:
      yield
    finally:
      with self.lock:  # once a callback started before the removal has ended
        self.callbacks.remove(callback)

  @contextlib.contextmanager
  def raising(self):
    """A block that a stop ends at once, raising `Stopped` in the main thread.

    For work before a run's first step (data checks, imports, building the
    graph, restoring, the first step's tracing), where nothing is written
    yet: waiting for it to finish (tens of seconds on a busy machine) would
    outlast a scheduler's grace period. Python runs the handler between two
    bytecodes of the main thread, so the exception comes at once there, or
    as soon as a call into C++ returns. Raises at entry if a stop came
    before. Blocks nest; outside the main thread nothing is raised.
    """
    if self.requested:
      raise Stopped(self.signal_name)
    self.raising_depth += 1
    try:
      yield
    except Exception as e:
      # The handler's Stopped may land inside library code that makes another
      # error of it (CPython's SystemError from a call into C, then TensorFlow's
      # "Could not pack sequence" while tracing): whatever leaves the block then is the stop.
      if self._raised:
        raise Stopped(self.signal_name) from e
      raise
    finally:
      self.raising_depth -= 1

  def _stop(self, signum):
    # No lock: the main thread's handler may run while that thread holds one.
    self.signal_name = self.signal_name or signal.Signals(signum).name
    self.set()

  def _handle(self, signum, frame):  # pylint: disable=unused-argument
    # The main thread's handler: marks the request, and raises in a
    # `raising` block (the watcher counts signals and runs callbacks; it saw
    # this one already or is about to).
    self._stop(signum)
    if self.raising_depth and not self._raised:  # once: not again in its unwinding
      self._raised = True
      raise Stopped(self.signal_name)

  def _watch(self, reader):
    received = 0
    with contextlib.suppress(OSError):
      while data := reader.recv(64):  # b'' once the writer is closed
        for signum in (s for s in data if s in STOP_SIGNALS):
          received += 1
          name = signal.Signals(signum).name
          if received > 1:
            ending.exit_now(128 + signum, f'{name} again: stopping at once, without saving; '
                                          'the steps since the last checkpoint are lost.')
          self._stop(signum)
          # On a thread of their own, so that this one stays free to end the
          # process on a second signal even if a callback blocks.
          threading.Thread(target=self._run_callbacks, args=(name,),
                           name='stop-callbacks', daemon=True).start()

  def _run_callbacks(self, name):
    with self.lock:
      for callback in reversed(self.callbacks):
        _run_callback(callback, name)


def _stops(error):
  """Whether `error` is a Stopped, or was caused by one."""
  while error is not None and not isinstance(error, Stopped):
    error = error.__cause__ or error.__context__
  return error is not None


def _run_callback(callback, name):
  try:
    callback(name)
  except Exception as e:  # pylint: disable=broad-except
    logger.warning(f'while stopping: {type(e).__name__}: {e}')


def exit_status(signal_name):
  """The shell's exit status of a run stopped by `signal_name` (a StopRequest's): 128 + its
  number, as if the signal had killed it: 130 for SIGINT, 143 for SIGTERM."""
  return 128 + signal.Signals[signal_name]
