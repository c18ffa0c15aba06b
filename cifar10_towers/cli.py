"""cifar10-towers: train, evaluate and cross-check the CIFAR-10 multi-GPU trainers.

TensorFlow is imported inside the commands, so `python cli.py --help` is instant.
Progress and metrics go to stdout, diagnostics to stderr.
"""

import logging
import os
import sys
import traceback

import click

# Keep TensorFlow's start-up chatter and tf.compat.v1 deprecation notices off
# the terminal unless asked for (TF_CPP_MIN_LOG_LEVEL=0 brings them back).
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
if os.environ['TF_CPP_MIN_LOG_LEVEL'] != '0':
  logging.getLogger('tensorflow').setLevel(logging.ERROR)

from cifar10_towers.common import config as config_lib  # pylint: disable=wrong-import-position
from cifar10_towers.common import devices  # pylint: disable=wrong-import-position
from cifar10_towers.common import errors  # pylint: disable=wrong-import-position
from cifar10_towers.common import hparams  # pylint: disable=wrong-import-position
from cifar10_towers.common import prog  # pylint: disable=wrong-import-position
from cifar10_towers.common import version  # pylint: disable=wrong-import-position

MAX_TOWERS = devices.MAX_TOWERS


logger = logging.getLogger(__name__)


def _configure_logging():
  """What the library says (loggers under cifar10_towers) goes to the CLI's one handler, once.

  common.progress.LogHandler: progress and metrics (below WARNING) to stdout,
  diagnostics to stderr, each line as it was said.
  """
  from cifar10_towers.common import progress  # pylint: disable=import-outside-toplevel
  package = logging.getLogger('cifar10_towers')
  if not any(isinstance(h, progress.LogHandler) for h in package.handlers):
    package.addHandler(progress.LogHandler())
  package.setLevel(logging.INFO)
  package.propagate = False  # said once, not again by a handler of the root logger


def _first_line(error):
  text = str(error).strip() or type(error).__name__
  return text.splitlines()[0]


def _check_train_dir(train_dir):
  """A train_dir must be a directory we can write, or creatable."""
  if os.path.exists(train_dir) and not os.path.isdir(train_dir):
    raise click.BadParameter('%s is a file, not a directory; pass another '
                             '--train_dir.' % train_dir, param_hint='--train_dir')
  probe = train_dir
  while not os.path.exists(probe):
    probe = os.path.dirname(probe) or '.'
  if not os.path.isdir(probe):
    raise click.BadParameter('%s is a file, so %s cannot be created under it; '
                             'pass another --train_dir.' % (probe, train_dir),
                             param_hint='--train_dir')
  if not os.access(probe, os.W_OK | os.X_OK):
    raise click.BadParameter('%s is not writable; pass a --train_dir you can '
                             'write to.' % probe, param_hint='--train_dir')


def _ensure_train_data(data_dir):
  """Finds the training data, downloading CIFAR-10 when it is missing (as upstream did).

  Returns:
    int, the number of training examples on disk.
  """
  from cifar10_towers.common import cifar10_format as fmt
  from cifar10_towers.common import download
  # Like upstream, download only when cifar-10-batches-bin/ is not there at
  # all: a download into a partial directory would replace the files in it.
  if not os.path.isdir(fmt.batches_dir(data_dir)):
    try:
      _download(data_dir)
    except download.DownloadError as e:
      # The DownloadError says how to get the archive or generate data.
      raise click.ClickException('no CIFAR-10 data in %s and the download '
                                 'failed: %s' % (data_dir, _first_line(e))) from None
  paths = fmt.train_files(data_dir)
  extra = fmt.unexpected_files(data_dir)
  if extra:
    raise fmt.DataError(
        '%s is not a CIFAR-10 data file, and training would silently ignore it '
        '(%d unexpected .bin file(s)). Move it out of %s; `%s` lists every '
        'problem.' % (extra[0], len(extra), fmt.batches_dir(data_dir),
                      prog.command('data check')))
  # Fail before building a graph on sizes and label bytes; say which files
  # cannot be real data (all one image, one label, copies), and go on.
  for line in fmt.judge_files(paths):
    logger.warning('Warning: %s. Training goes on; `%s` lists every problem.',
                   line, prog.command('data check --data_dir %s' % data_dir))
  return fmt.num_examples(paths)


def _download(data_dir):
  from cifar10_towers.common import download
  url = os.environ.get('CIFAR10_DATA_URL', download.DATA_URL)
  bar = None

  def progress(done, total):
    nonlocal bar
    if bar is None:
      bar = click.progressbar(length=total or download.ARCHIVE_BYTES,
                              label='Downloading %s' % url, file=sys.stderr)
      bar.__enter__()
    bar.update(done - bar.pos)

  try:
    return download.maybe_download_and_extract(
        data_dir, url=url, sha256=download.ARCHIVE_SHA256, progress=progress)
  except download.DownloadError as e:
    if not str(e).startswith('refusing to unpack'):
      raise
    # An unsafe archive that passed the digest: say what to do as well.
    raise download.DownloadError(
        '%s; nothing was written. This is not the CIFAR-10 archive: fetch it '
        'from %s instead (unset CIFAR10_DATA_URL).' % (_first_line(e),
                                                        download.DATA_URL)) from None
  finally:
    if bar is not None:
      bar.__exit__(None, None, None)


def _train_options(f):
  """The original's flags, shared by `legacy` and `modern` so they mean the same."""
  options = [
      click.option('--num_gpus', type=click.IntRange(1, MAX_TOWERS), default=1,
                   show_default=True,
                   help='Number of towers, one per GPU; with fewer GPUs the CPU '
                        'is split into this many logical devices.'),
      click.option('--data_dir', type=click.Path(file_okay=False),
                   default=config_lib.DEFAULT_DATA_DIR, show_default=True,
                   envvar='CIFAR10_DATA_DIR',
                   help='Directory holding cifar-10-batches-bin/ (env CIFAR10_DATA_DIR).'),
      click.option('--train_dir', type=click.Path(), show_default=True,
                   default=config_lib.DEFAULT_TRAIN_DIR, envvar='CIFAR10_TRAIN_DIR',
                   help='Where checkpoints and summaries go; a run resumes from '
                        'the newest checkpoint here (env CIFAR10_TRAIN_DIR).'),
      click.option('--batch_size', type=click.IntRange(min=1),
                   default=hparams.BATCH_SIZE, show_default=True,
                   help='Images per tower per step.'),
      click.option('--max_steps', type=click.IntRange(min=0), default=1000000,
                   show_default=True, help='Train until the global step reaches this.'),
      click.option('--log_every', type=click.IntRange(min=1), default=10,
                   show_default=True, help='Steps between log lines.'),
      click.option('--summary_every', type=click.IntRange(min=1), default=100,
                   show_default=True, help='Steps between TensorBoard summaries.'),
      click.option('--save_every', type=click.IntRange(min=1), default=1000,
                   show_default=True, help='Steps between checkpoints; one is '
                   'also written at the end and on Ctrl-C.'),
      click.option('--log_device_placement', is_flag=True,
                   help='Print the device of every op.'),
      click.option('--seed', type=int, default=None,
                   help='Random seed for initialization and input; unset means '
                        'nondeterministic.'),
      click.option('--crosscheck', 'run_crosscheck', is_flag=True,
                   help='Before training, prove on batches of --data_dir that '
                        'legacy and modern compute the same averaged gradients.'),
  ]
  for option in reversed(options):
    f = option(f)
  return f


def _optimizer_options(f):
  """The update rule, shared by `legacy`, `modern` and `crosscheck` (common.optimizer)."""
  from cifar10_towers.common import optimizer as optimizer_lib
  defaults = optimizer_lib.Optimizer()
  options = [
      click.option('--optimizer', type=click.Choice(optimizer_lib.NAMES),
                   default=defaults.name, show_default=True,
                   help='sgd: upstream\'s plain gradient descent; momentum and '
                        'adam: TF1\'s MomentumOptimizer and AdamOptimizer (both '
                        'trainers compute the same update). The learning rate '
                        'follows upstream\'s staircase decay in all three.'),
      click.option('--learning_rate', type=click.FloatRange(min=0.0, min_open=True),
                   default=defaults.learning_rate, show_default=True,
                   help='Initial learning rate (upstream\'s 0.1; Adam wants '
                        'about 0.001).'),
      click.option('--momentum', type=click.FloatRange(min=0.0),
                   default=defaults.momentum, show_default=True,
                   help='--optimizer momentum: accum = momentum * accum + grad.'),
      click.option('--adam_beta1', type=click.FloatRange(0.0, 1.0, max_open=True),
                   default=defaults.adam_beta1, show_default=True,
                   help='--optimizer adam: decay of the first moment.'),
      click.option('--adam_beta2', type=click.FloatRange(0.0, 1.0, max_open=True),
                   default=defaults.adam_beta2, show_default=True,
                   help='--optimizer adam: decay of the second moment.'),
      click.option('--adam_epsilon', type=click.FloatRange(min=0.0, min_open=True),
                   default=defaults.adam_epsilon, show_default=True,
                   help='--optimizer adam: added to sqrt(v).'),
      click.option('--clip_norm', type=click.FloatRange(min=0.0, min_open=True),
                   default=None,
                   help='Clip the gradients to this global norm '
                        '(tf.clip_by_global_norm); default: no clipping.'),
      click.option('--clip_where', type=click.Choice(optimizer_lib.CLIP_WHERE),
                   default=defaults.clip_where, show_default=True,
                   help='averaged: clip the towers\' mean gradient; per_tower: '
                        'clip each tower\'s before the mean, which is NOT the '
                        'same as one tower on all the images (README).'),
  ]
  for option in reversed(options):
    f = option(f)
  return f


def _optimizer_from(options):
  """Pops the optimizer flags from a command's options: common.optimizer.Optimizer.

  A flag that the chosen optimizer ignores is a usage error (exit 2), so a
  typo such as `--adam_beta1` with `--optimizer momentum` is not lost.
  """
  from cifar10_towers.common import optimizer as optimizer_lib
  values = {name: options.pop(name) for name in (
      'optimizer', 'learning_rate', 'momentum', 'adam_beta1', 'adam_beta2',
      'adam_epsilon', 'clip_norm', 'clip_where')}
  source = click.get_current_context().get_parameter_source
  given = {name for name in values
           if source(name) != click.core.ParameterSource.DEFAULT}
  needs = {'momentum': 'momentum', 'adam_beta1': 'adam', 'adam_beta2': 'adam',
           'adam_epsilon': 'adam'}
  for name, optimizer in needs.items():
    if name in given and values['optimizer'] != optimizer:
      raise click.UsageError('--%s is for --optimizer %s (this run has --optimizer '
                             '%s).' % (name, optimizer, values['optimizer']))
  if 'clip_where' in given and values['clip_norm'] is None:
    raise click.UsageError('--clip_where needs --clip_norm.')
  return optimizer_lib.Optimizer(
      name=values['optimizer'], learning_rate=values['learning_rate'],
      momentum=values['momentum'], adam_beta1=values['adam_beta1'],
      adam_beta2=values['adam_beta2'], adam_epsilon=values['adam_epsilon'],
      clip_norm=values['clip_norm'], clip_where=values['clip_where'])


def _train(impl, num_gpus, data_dir, train_dir, batch_size, max_steps, log_every,
           summary_every, save_every, log_device_placement, seed, run_crosscheck,
           **distribution):
  optimizer = _optimizer_from(distribution)
  stop = click.get_current_context().meta[_STOP]
  # Until the first step nothing is written, so there a stop ends the run at
  # once (training.Stopped, which _Group.invoke reports).
  with stop.raising():
    _check_train_dir(train_dir)
    if distribution:
      _check_distribution(run_crosscheck=run_crosscheck, **distribution)
    if distribution.get('strategy') == 'multiworker' and num_gpus > 1:
      _check_multiworker_gpus(num_gpus)
    _ensure_train_data(data_dir)
    _say_if_generated(data_dir, 'Training')
    plan = devices.plan_devices(num_gpus)
    from cifar10_towers.common import memory  # refuse what cannot fit, before building
    memory.check_training(impl, plan, batch_size, data_dir)
    config = config_lib.TrainConfig(
        data_dir=data_dir, train_dir=train_dir, num_gpus=num_gpus,
        batch_size=batch_size, max_steps=max_steps, log_every=log_every,
        summary_every=summary_every, save_every=save_every,
        log_device_placement=log_device_placement, seed=seed,
        optimizer=optimizer, **distribution)
    if run_crosscheck:
      _crosscheck(plan, batch_size=batch_size, steps=5, seed=seed or 0,
                  data_dir=data_dir, decay_steps=2, dump=None, rtol=None,
                  engines=('towers', 'mirrored')
                  if config.strategy == 'mirrored' else ('towers',),
                  optimizer=optimizer)
    if impl == 'legacy':
      from cifar10_towers.legacy import train as trainer
    else:
      from cifar10_towers.modern import train as trainer
  from cifar10_towers.common import progress
  try:
    trainer.train(config, plan)
  finally:
    progress.end_line()


# Set to 1, a failure also prints its traceback (its causes included) before
# its one line; otherwise no TensorFlow op, node block or traceback is shown.
DEBUG_ENV = 'CIFAR10_TOWERS_DEBUG'
_STOP = 'cifar10_towers.stop'  # ctx.meta key of the command's StopRequest
_COMMAND = 'cifar10_towers.command'  # ctx.meta key of the command's name ('data synth')
# Commands that own a loop and answer a stop at its boundaries, saying what
# they kept; every other command ends at once (training.Stopped), its writers
# leaving nothing half-written.
_LOOP_COMMANDS = ('legacy', 'modern', 'eval')


class _Group(click.Group):
  """The one place where a command of this CLI ends: a failure, a stop signal.

  A common.errors.Failure (what a user did wrong or the world did to a
  run) is said in its one line, with its exit code; an OSError as the path
  problem or the closed stream it is. Anything else is a bug: its traceback
  shows.

  A StopRequest is held around every command (common.training.STOP_SIGNALS).
  A stop before a loop's first step, or in a command without a loop, raises
  training.Stopped, which ends here with one line; a loop that stopped at a
  boundary has said what it kept. Either way the exit status is 128 + the
  signal's number, as if killed by it, so `train && eval` stops there.
  """

  @staticmethod
  def _fail(e):
    """The one place a user's or the world's error is said: its line, its exit code."""
    from cifar10_towers.common import ending  # pylint: disable=import-outside-toplevel
    if isinstance(e, errors.Failure):
      if e.exit_code == 2:
        raise click.UsageError(e.line()) from None
      raise click.ClickException(e.line()) from None
    if ending.stream_closed(e):  # stdout's reader is gone (`| head`, a closed terminal)
      ending.silence_stdout()
      raise click.ClickException(ending.cause(e) + '.') from None
    raise click.ClickException('%s. Check the path and its permissions.'
                               % _first_line(e)) from None

  def invoke(self, ctx):
    from cifar10_towers.common import ending  # pylint: disable=import-outside-toplevel
    from cifar10_towers.common import training  # pylint: disable=import-outside-toplevel
    stop = ctx.meta[_STOP] = ctx.with_resource(training.StopRequest())
    result = None
    try:
      result = super().invoke(ctx)  # `cli` below enters stop.raising() where it applies
    except (errors.Failure, OSError) as e:
      if os.environ.get(DEBUG_ENV) == '1':  # the whole story, before the one line
        traceback.print_exception(e)
      self._fail(e)
    except training.Stopped as stopped:
      command = ctx.meta.get(_COMMAND)
      ending.say(str(stopped) if command in ('legacy', 'modern')
                 else 'Stopped by %s; `%s` did not finish, and left nothing '
                 'half-written.' % (stopped.signal_name, command))
    if not stop.requested:
      return result
    # Set when a signal stopped the command. By then the checkpoint is
    # written, the input threads are joined and the summaries flushed, so
    # `main` skips TensorFlow's interpreter teardown (1-2 s, several times
    # that on a busy machine) and a scheduler's grace period (`docker stop`:
    # 10 s) is met.
    global _stopped_by_signal  # pylint: disable=global-statement
    _stopped_by_signal = True
    return ctx.exit(training.exit_status(stop.signal_name))


@click.group(cls=_Group, context_settings={'help_option_names': ['-h', '--help']})
@click.version_option(version.__version__, prog_name=prog.CONSOLE_SCRIPT)
@click.pass_context
def cli(ctx):
  """Train, evaluate and cross-check the TensorFlow CIFAR-10 multi-GPU trainers.

  `legacy` runs the faithful TF1 port (queue runners, prefetch_queue);
  `modern` runs the same algorithm in TF2 (tf.data, tf.function towers).

  Ctrl-C and the other stop signals end any command with one line on stderr
  and 128 + the signal's number; training saves the step it reached first.
  Every way a run ends, and its exit status: docs/ending.md.
  """
  _configure_logging()
  ctx.meta[_COMMAND] = ctx.invoked_subcommand
  if ctx.invoked_subcommand not in _LOOP_COMMANDS:
    ctx.with_resource(ctx.meta[_STOP].raising())


@cli.command()
@_train_options
@_optimizer_options
def legacy(**options):
  """Train with the original queue-runner multi-tower trainer (tf.compat.v1)."""
  _train('legacy', **options)


def _strategy_options(f):
  """How `modern` spreads the step: its own towers, or a tf.distribute engine."""
  options = [
      click.option('--strategy', type=click.Choice(config_lib.STRATEGIES),
                   default='towers', show_default=True,
                   help='towers: one tf.function tower per device; mirrored: '
                        'tf.distribute.MirroredStrategy over the same devices; '
                        'multiworker: MultiWorkerMirroredStrategy, --num_gpus '
                        'replicas (GPUs; 1 on a CPU-only machine) on each of '
                        'several workers (TF_CONFIG, or --worker_hosts and '
                        '--task_index).'),
      click.option('--worker_hosts', default='', metavar='HOST:PORT,...',
                   callback=_parse_worker_hosts,
                   help='Every worker of a multiworker run, the same list on '
                        'each; instead of TF_CONFIG.'),
      click.option('--task_index', type=click.IntRange(min=0), default=0,
                   show_default=True,
                   help='This worker\'s index in --worker_hosts; 0 is the chief, '
                        'which writes checkpoints and logs.'),
      click.option('--peer_timeout', type=click.IntRange(min=1),
                   default=config_lib.TrainConfig.peer_timeout, show_default=True,
                   help='Seconds a multiworker step waits for the other workers; '
                        'then the worker stops with an error instead of hanging.'),
      click.option('--startup_timeout', type=click.IntRange(min=1),
                   default=config_lib.TrainConfig.startup_timeout,
                   show_default=True,
                   help='Seconds a multiworker worker waits for the others to '
                        'start; then it stops with an error naming those that '
                        'did not answer.'),
  ]
  for option in reversed(options):
    f = option(f)
  return f


def _parse_worker_hosts(ctx, param, value):  # pylint: disable=unused-argument
  if not value:
    return ()
  from cifar10_towers.modern import cluster  # no TensorFlow: usage errors come at once
  try:
    return cluster.parse_worker_hosts(value)
  except cluster.ClusterError as e:
    raise click.BadParameter(_first_line(e)) from None


def _check_distribution(strategy, worker_hosts, task_index, peer_timeout,
                        startup_timeout, run_crosscheck):
  """Bad combinations of the strategy flags are usage errors (exit 2)."""
  del peer_timeout, startup_timeout  # any values >= 1 are fine
  from cifar10_towers.modern import cluster  # no TensorFlow: usage errors come at once
  source = click.get_current_context().get_parameter_source
  given = [name for name in ('worker_hosts', 'task_index', 'startup_timeout')
           if source(name) != click.core.ParameterSource.DEFAULT]
  if strategy != 'multiworker':
    if given:
      raise click.UsageError('--%s is for --strategy multiworker.' % given[0])
    return
  if run_crosscheck:
    raise click.UsageError('--crosscheck runs in one process; run `%s` before '
                           'a --strategy multiworker run.'
                           % prog.command('crosscheck'))
  if worker_hosts and task_index >= len(worker_hosts):
    raise click.BadParameter('%d is not an index of the %d --worker_hosts (0..%d).'
                             % (task_index, len(worker_hosts), len(worker_hosts) - 1),
                             param_hint='--task_index')
  if 'task_index' in given and not worker_hosts:
    raise click.UsageError('--task_index needs --worker_hosts (or set TF_CONFIG '
                           'instead of both).')
  try:
    cluster.resolve_cluster(worker_hosts, task_index)
  except cluster.ClusterError as e:
    raise click.UsageError(_first_line(e)) from None


def _check_multiworker_gpus(num_gpus):
  """--strategy multiworker takes a replica per GPU, or one on a CPU-only machine."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  found = len(tf.config.list_physical_devices('GPU'))
  if found < num_gpus:
    raise click.UsageError(
        '--strategy multiworker runs one replica per GPU, and this machine has '
        '%d GPU(s) for --num_gpus %d; on CPUs TensorFlow runs one replica per '
        'worker: pass --num_gpus 1 and start more workers.' % (found, num_gpus))


@cli.command()
@_train_options
@_optimizer_options
@_strategy_options
def modern(**options):
  """Train with the TF2 rewrite: tf.data input, one tf.function tower per device."""
  _train('modern', **options)


def _evaluate_by_kind(data_dir, batch_size, num_examples, num_records):
  """What `common.evaluation.run` calls: each checkpoint by its own trainer's evaluator.

  Chosen per checkpoint, not once: one train_dir can hold either trainer's
  checkpoints over time. legacy/ and modern/ never import each other; the
  dispatch is here. Each evaluation shows its progress over the num_records
  test records (`common.progress`): a bar on a terminal, else a line as it
  begins and a few more if it is slow.
  """
  from cifar10_towers.common import checkpoints
  from cifar10_towers.common import progress as progress_lib

  def evaluate(contents, should_stop):
    name = os.path.basename(contents.path)
    with progress_lib.Progress(num_records, 'Evaluating %s' % name,
                               'records') as progress:
      progress.stage(0, 'Evaluating %s on %d test records...'
                     % (name, num_records))
      if contents.kind == checkpoints.LEGACY:
        from cifar10_towers.legacy import eval as evaluator
      else:
        from cifar10_towers.modern import eval as evaluator
      return evaluator.evaluate_contents(contents, data_dir, batch_size,
                                         num_examples, should_stop,
                                         progress=progress.update)

  return evaluate


@cli.command(name='eval')
@click.option('--checkpoint_dir', type=click.Path(file_okay=False),
              default=config_lib.DEFAULT_TRAIN_DIR, show_default=True,
              envvar='CIFAR10_TRAIN_DIR',
              help='A train_dir of either trainer (env CIFAR10_TRAIN_DIR).')
@click.option('--data_dir', type=click.Path(file_okay=False),
              default=config_lib.DEFAULT_DATA_DIR, show_default=True,
              envvar='CIFAR10_DATA_DIR', help='Directory holding cifar-10-batches-bin/.')
@click.option('--num_examples', type=click.IntRange(min=1), default=None,
              help='Evaluate the first N test records; default all of them.')
@click.option('--batch_size', type=click.IntRange(min=1), default=hparams.BATCH_SIZE,
              show_default=True, help='Images per evaluation batch.')
@click.option('--run_once', is_flag=True,
              help='Evaluate the newest checkpoint and exit, instead of waiting '
                   'for new ones.')
@click.option('--eval_interval_secs', type=click.IntRange(min=1), default=300,
              show_default=True, help='How often to look for a new checkpoint.')
@click.option('--eval_dir', type=click.Path(), default=None, envvar='CIFAR10_EVAL_DIR',
              help='Where precision @ 1 goes for TensorBoard (tag "Precision @ '
                   '1", at each checkpoint\'s global step); created if missing, '
                   'its event files kept (env CIFAR10_EVAL_DIR). Default: '
                   '<checkpoint_dir>/eval, so `tensorboard --logdir '
                   '<checkpoint_dir>` shows training and precision together; '
                   '%s if the checkpoint_dir cannot be written.'
                   % config_lib.DEFAULT_EVAL_DIR)
def eval_command(checkpoint_dir, data_dir, num_examples, batch_size, run_once,
                 eval_interval_secs, eval_dir):
  """Print precision @ 1 on the test set with the moving-average weights.

  Evaluates the newest intact checkpoint (saying which it skipped, and why),
  then, without --run_once, each new one as training writes it, until Ctrl-C.
  Each precision also goes to --eval_dir for TensorBoard.
  """
  # A signal while TensorFlow loads or a batch runs is a request to stop
  # (_Group), answered with one line and 128 + its number.
  stop = click.get_current_context().meta[_STOP]
  from cifar10_towers.common import cifar10_format as fmt
  from cifar10_towers.common import evaluation
  paths = fmt.eval_files(data_dir)
  for line in fmt.judge_files(paths):  # reads and validates every record
    logger.warning('Warning: %s; a precision measured on it means nothing.', line)
  _say_if_generated(data_dir, 'Evaluating')
  available = fmt.num_examples(paths)
  if num_examples is not None and num_examples > available:
    logger.warning('--num_examples %d is more than the %d records of the test set in '
                   '%s; evaluating all %d.', num_examples, available, data_dir, available)
  evaluation.run(checkpoint_dir,
                 _evaluate_by_kind(data_dir, batch_size, num_examples,
                                   min(num_examples or available, available)),
                 stop,
                 interval_secs=None if run_once else eval_interval_secs,
                 eval_dir=eval_dir or _default_eval_dir(checkpoint_dir))


def _default_eval_dir(checkpoint_dir):
  """<checkpoint_dir>/eval, so `tensorboard --logdir TRAIN_DIR` shows a run's
  training and precision together; upstream's /tmp/cifar10_eval where the
  train_dir cannot be written (a read-only copy), said in one line."""
  # Deviation from upstream: eval's summaries go under the train_dir it evaluates.
  eval_dir = os.path.join(checkpoint_dir, config_lib.EVAL_SUBDIR)
  probe = eval_dir
  while not os.path.exists(probe):
    probe = os.path.dirname(probe) or '.'
  if os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK):
    return eval_dir
  logger.warning('%s cannot be written; precision @ 1 goes to %s for TensorBoard (pass '
                 '--eval_dir to choose).', checkpoint_dir, config_lib.DEFAULT_EVAL_DIR)
  return config_lib.DEFAULT_EVAL_DIR


def _crosscheck(plan, batch_size, steps, seed, data_dir, decay_steps, dump, rtol,
                engines=('towers',), optimizer=None):
  """Runs the cross-check, prints its tables; ClickException (exit 1) if it fails."""
  from cifar10_towers import crosscheck as crosscheck_lib
  tolerances = None if rtol is None else {'grad_rtol': rtol}
  reports, images, labels, init = crosscheck_lib.run(
      plan, batch_size=batch_size, steps=steps, seed=seed, data_dir=data_dir,
      decay_steps=decay_steps, engines=engines, tolerances=tolerances,
      **({} if optimizer is None else {'optimizer': optimizer}))
  for engine, report in reports.items():
    click.echo('legacy vs modern (%s):' % engine)
    click.echo(crosscheck_lib.format_report(report))
  if dump:
    path = crosscheck_lib.write_evidence(dump, images, labels, init,
                                         reports[engines[0]])
    click.echo('Evidence written to %s.' % path)
  failed = {engine: r for engine, r in reports.items() if not r.passed}
  if failed:
    raise click.ClickException(
        'cross-check failed: %s outside the contract (rows marked FAIL above); '
        'legacy and modern do not compute the same thing.'
        % ', '.join('%d of %d figures of legacy vs %s' % (
            len(r.failures()), len(r.rows), engine) for engine, r in failed.items()))


@cli.command()
@click.option('--num_gpus', type=click.IntRange(1, MAX_TOWERS), default=2,
              show_default=True, help='Number of towers N.')
@click.option('--batch_size', type=click.IntRange(min=1), default=16,
              show_default=True, help='Images per tower.')
@click.option('--steps', type=click.IntRange(min=0), default=5, show_default=True,
              help='Training steps K before comparing variables and moving averages.')
@click.option('--seed', type=int, default=0, show_default=True,
              help='Seeds the batches and the initial variables.')
@click.option('--data_dir', type=click.Path(file_okay=False), default=None,
              help='Draw the batches from this data dir; default: generated data.')
@click.option('--decay_steps', type=click.IntRange(min=1), default=2,
              show_default=True,
              help='Learning-rate decay interval, small so K steps cross the staircase.')
@click.option('--dump', type=click.Path(file_okay=False), default=None,
              help='Write the evidence file DIR/crosscheck.npz (docs/equivalence.md §2).')
@click.option('--rtol', type=click.FloatRange(min=0.0), default=None,
              help='Tolerance of the averaged-gradient and identity checks '
                   '[default: 1e-5, the contract].')
@click.option('--strategy', type=click.Choice(['towers', 'mirrored']),
              default='towers', show_default=True,
              help='mirrored also compares tf.distribute.MirroredStrategy with '
                   'legacy (3-way: legacy, towers, mirrored).')
@_optimizer_options
def crosscheck(num_gpus, batch_size, steps, seed, data_dir, decay_steps, dump, rtol,
               strategy, **optimizer_options):
  """Prove legacy and modern compute the same averaged gradients (docs/equivalence.md §2).

  Builds both trainers from the same initial variables, feeds both the same N
  tower batches, and compares the averaged gradients, the tower losses, the
  variables and moving averages after K steps, and the N-towers-vs-1 identity.
  Exits 0 when every figure is within the contract, 1 otherwise. With
  --optimizer momentum or adam it also compares every slot after K steps,
  with --clip_norm the clipped averaged gradient.
  """
  optimizer = _optimizer_from(optimizer_options)
  if data_dir is not None:
    _ensure_train_data(data_dir)
  plan = devices.plan_devices(num_gpus)
  engines = ('towers', 'mirrored') if strategy == 'mirrored' else ('towers',)
  _crosscheck(plan, batch_size, steps, seed, data_dir, decay_steps, dump, rtol,
              engines, optimizer)


@cli.command()
@click.argument('impl', type=click.Choice(['legacy', 'modern']))
@click.option('--num_gpus', type=click.IntRange(1, MAX_TOWERS), default=2,
              show_default=True, help='Number of towers N.')
@click.option('--batch_size', type=click.IntRange(min=1), default=hparams.BATCH_SIZE,
              show_default=True, help='Images per tower.')
@click.option('--steps', type=click.IntRange(min=1), default=10, show_default=True,
              help='Traced steps K, after a few untraced warm-up steps.')
@click.option('--data_dir', type=click.Path(file_okay=False), default=None,
              envvar='CIFAR10_DATA_DIR',
              help='Directory holding cifar-10-batches-bin/; default: small generated data.')
@click.option('--out', 'out_dir', type=click.Path(file_okay=False),
              default='profile_out', show_default=True,
              help='Where trace.json (Perfetto, chrome://tracing), timeline.png '
                   'and report.json go.')
@click.option('--misplace_tower', type=click.IntRange(min=0), default=None,
              help='Demonstration: pin this tower to the variables\' device '
                   '(/cpu:0), as a stray tf.device would, and see it flagged.')
def profile(impl, num_gpus, batch_size, steps, data_dir, out_dir, misplace_tower):
  """Show whether the towers run in parallel, and where their time goes.

  Trains K steps of one trainer in a scratch train_dir (never yours) under
  TensorFlow's tracing, then reports per device the busy fraction and the
  time in tower forward/backward, gradient averaging, the update, the moving
  averages, input and copies; how much the towers overlap; and on which
  device each tower's ops ran, flagging a tower that ran elsewhere than
  planned. Writes a Chrome trace, a PNG timeline and the report as JSON.
  """
  if misplace_tower is not None and misplace_tower >= num_gpus:
    raise click.BadParameter('must be below --num_gpus (%d), got %d'
                             % (num_gpus, misplace_tower),
                             param_hint='--misplace_tower')
  if data_dir is not None:
    _ensure_train_data(data_dir)
  from cifar10_towers.common import devices
  plan = devices.plan_devices(num_gpus)  # before TensorFlow starts
  from cifar10_towers.towerprofile import run as profile_lib
  click.echo('Profiling %d step(s) of %s on %d tower(s) under TensorFlow\'s tracing...'
             % (steps, impl, num_gpus))
  report, written = profile_lib.profile(
      impl, plan, batch_size, steps, data_dir=data_dir, out_dir=out_dir,
      misplace_tower=misplace_tower)
  click.echo('\n'.join(profile_lib.format_report(report)))
  for name, path in sorted(written.items()):
    click.echo('Wrote %s (%s).' % (path, name))


@cli.command()
@click.option('--from_dir', type=click.Path(file_okay=False), required=True,
              help='A train_dir of either trainer; its newest checkpoint is converted.')
@click.option('--to_dir', type=click.Path(), required=True,
              help='A new or empty directory, outside --from_dir, for the other '
                   'trainer\'s checkpoint.')
def convert(from_dir, to_dir):
  """Turn a legacy train_dir into a modern one, or back.

  Weights, moving averages, the global step and the optimizer's slots
  (momentum, Adam) move bit for bit; training continues from the converted
  checkpoint and eval gives the same precision.
  """
  click.echo('Converting the newest checkpoint of %s into %s...' % (from_dir, to_dir))
  from cifar10_towers import convert as convert_lib
  from_kind, to_kind, step, path = convert_lib.convert(from_dir, to_dir)
  optimizer = convert_lib.read_state(path)[4]
  click.echo('Converted the %s checkpoint of %s at global step %d to a %s '
             'checkpoint (optimizer %s, its slots included): %s'
             % (from_kind, from_dir, step, to_kind, optimizer, path))
  # A resume with another --optimizer is refused: say which one it needs.
  click.echo('Continue with `%s`.' % prog.command('%s --train_dir %s%s' % (
      to_kind, to_dir, '' if optimizer == 'sgd' else ' --optimizer %s' % optimizer)))


def _comma_list(convert, allowed=None, bound=None):
  """A click callback turning 'a,b' into a tuple, each item checked."""

  def callback(ctx, param, value):  # pylint: disable=unused-argument
    items = []
    for text in value.split(','):
      text = text.strip()
      try:
        item = convert(text)
      except ValueError:
        raise click.BadParameter('%r is not a valid item of a comma-separated '
                                 'list, e.g. %s.' % (text, param.default)) from None
      if allowed is not None and item not in allowed:
        raise click.BadParameter('%r is not one of %s.' % (item, ', '.join(allowed)))
      if bound is not None and not bound[0] <= item <= bound[1]:
        raise click.BadParameter('%r is not between %d and %d.' % (item, *bound))
      if item not in items:
        items.append(item)
    return tuple(items)

  return callback


@cli.command()
@click.option('--impl', default='legacy,modern', show_default=True,
              callback=_comma_list(str, allowed=('legacy', 'modern')),
              help='Trainers to measure, comma-separated.')
@click.option('--num_gpus', default='1,2', show_default=True,
              callback=_comma_list(int, bound=(1, MAX_TOWERS)),
              help='Tower counts, comma-separated; without GPUs the CPU is split '
                   'into that many logical devices.')
@click.option('--batch_size', type=click.IntRange(min=1), default=hparams.BATCH_SIZE,
              show_default=True, help='Images per tower per step.')
@click.option('--data_dir', type=click.Path(file_okay=False), default=None,
              help='CIFAR-10 data to train on; default: generated data of '
                   'CIFAR-10\'s size in a temporary directory.')
@click.option('--rounds', type=click.IntRange(min=1), default=10, show_default=True,
              help='Timed rounds: one window of each contender (Keras, legacy, '
                   'modern, ...) in turn; rates and ratios are medians over rounds.')
@click.option('--warmup_rounds', type=click.IntRange(min=0), default=2,
              show_default=True, help='Rounds run first and not counted.')
@click.option('--window_steps', type=click.IntRange(min=1), default=10,
              show_default=True, help='Training steps per window.')
@click.option('--matmul_size', type=click.IntRange(min=1), default=4096,
              show_default=True,
              help='Size n of the n x n fp32 matmuls measuring the matmul rate.')
@click.option('--json', 'json_path', type=click.Path(dir_okay=False), default=None,
              help='Also write the results to this JSON file.')
@click.option('--jit', is_flag=True,
              help='Compile each tower\'s loss and gradients with XLA in both '
                   'trainers (the Keras baseline keeps its default).')
@click.option('--plot', 'plot_path', type=click.Path(dir_okay=False), default=None,
              help='Also draw the results as a PNG bar chart (needs matplotlib: '
                   'pip install matplotlib, or the [profile] extra).')
@click.option('--from_json', type=click.Path(exists=True, dir_okay=False),
              default=None,
              help='Measure nothing: read the results of an earlier --json run, '
                   'print its table and draw it with --plot.')
@click.pass_context
def bench(ctx, impl, num_gpus, batch_size, data_dir, rounds, warmup_rounds,
          window_steps, matmul_size, json_path, jit, plot_path, from_json):
  """Measure training images/sec against Keras model.fit and the matmul rate.

  For each trainer and tower count: steady-state training images/sec of the
  trainer's real loop and input pipeline, and of the same net in Keras
  `model.fit` under MirroredStrategy with in-memory data, window by window in
  turn for several rounds; then each input pipeline alone. The matmul
  estimate is the best fp32 matmul rate measured over the FLOPs of one
  training image: a sample under the same load, not a bound.
  Each contender runs in its own process. Prints progress and a table
  (stdout); --json keeps the results, --plot draws them as a PNG, and
  --from_json reads a --json file back instead of measuring.
  """
  from cifar10_towers import bench as bench_lib
  if from_json is not None:
    given = [p.opts[0] for p in ctx.command.params
             if p.name not in ('plot_path', 'from_json')
             and ctx.get_parameter_source(p.name) in (
                 click.core.ParameterSource.COMMANDLINE,
                 click.core.ParameterSource.ENVIRONMENT)]
    if given:
      raise click.UsageError('--from_json draws results measured earlier; it takes '
                             'only --plot, not %s.' % ', '.join(given))
    report = bench_lib.read_json(from_json)
    click.echo(bench_lib.format_table(report))
    _bench_plot(bench_lib, report, plot_path)
    return
  if plot_path is not None:
    bench_lib.check_plotting()  # before minutes of measuring, not after
  if data_dir is not None:
    from cifar10_towers.common import cifar10_format as fmt
    for path in fmt.train_files(data_dir):
      fmt.read_records(path)
  config = bench_lib.BenchConfig(
      impls=impl, num_gpus=num_gpus, batch_size=batch_size, data_dir=data_dir,
      rounds=rounds, warmup_rounds=warmup_rounds, window_steps=window_steps,
      matmul_size=matmul_size, jit=jit)
  try:
    report = bench_lib.run(config)
  except bench_lib.BenchError as e:
    raise click.ClickException('%s. Run the measurement again; if it keeps '
                               'failing, train once with the same flags to '
                               'see the error.' % _first_line(e)) from None
  click.echo(bench_lib.format_table(report))
  if json_path:
    bench_lib.write_json(report, json_path)
    click.echo('Wrote %s.' % json_path)
  _bench_plot(bench_lib, report, plot_path)


def _bench_plot(bench_lib, report, plot_path):
  """Draws `report` into plot_path (if given); one-line errors."""
  if plot_path is None:
    return
  try:
    bench_lib.plot(report, plot_path)
  except errors.Failure:
    raise
  except (OSError, KeyError, TypeError, ValueError) as e:
    raise click.ClickException('cannot draw %s: %s' % (plot_path, _first_line(e))) from None
  click.echo('Wrote %s.' % plot_path)


@cli.group()
@click.pass_context
def data(ctx):
  """Get, generate or check CIFAR-10 data in the binary format."""
  ctx.meta[_COMMAND] = 'data %s' % ctx.invoked_subcommand


_data_dir_option = click.option(
    '--data_dir', type=click.Path(file_okay=False),
    default=config_lib.DEFAULT_DATA_DIR, show_default=True, envvar='CIFAR10_DATA_DIR',
    help='Directory that holds (or will hold) cifar-10-batches-bin/.')


_force_option = click.option(
    '--force', is_flag=True,
    help='Also replace data this command did not write: CIFAR-10, your own, '
         'or the other generator\'s.')


def _replacing(data_dir, generator, force):
  """What `data <generator>` would replace in data_dir; refuses with exit 1.

  `data synth` and `data digits` treat what is there alike: each replaces its
  own kind of generated data, and anything else - data without a marker
  (CIFAR-10, a 170 MB download, or the user's own) or the other generator's
  data - only with --force.

  Returns:
    str: '' when there is no data, else ', replacing ...' for the report line.
  """
  from cifar10_towers.common import generated
  marker = generated.read(data_dir)
  if marker is None:
    if not generated.holds_data(data_dir):
      return ''
    what = 'data not marked as generated (CIFAR-10, or your own)'
  elif marker['generator'] == generator:
    return ', replacing the %s there' % generated.describe(marker)
  else:
    what = generated.describe(marker)
  if not force:
    raise click.ClickException(
        '%s holds %s; left it as it is. Pass --force to replace it with '
        'generated data (%s), or pass another --data_dir.'
        % (data_dir, what, generator))
  return ', replacing the %s there (--force)' % what


def _say_written(counts, generator, data_dir, replacing):
  from cifar10_towers.common import generated
  click.echo('Wrote %d training and %d test records of generated data (%s) to '
             '%s%s. It is not CIFAR-10 (%s).' % (
                 sum(v for k, v in counts.items() if k.startswith('data_batch')),
                 counts.get('test_batch.bin', 0), generator, data_dir, replacing,
                 generated.CIFAR10_RESULT))


def _say_if_generated(data_dir, doing):
  """One line on stderr when data_dir holds generated data, not CIFAR-10."""
  from cifar10_towers.common import generated
  marker = generated.read(data_dir)
  if marker is not None:
    logger.warning('%s on %s in %s, not on CIFAR-10 (%s).', doing,
                   generated.describe(marker), data_dir, generated.CIFAR10_RESULT)


@data.command()
@_data_dir_option
@click.option('--train_per_file', type=click.IntRange(min=1), default=1000,
              show_default=True, help='Records in each of the 5 training files.')
@click.option('--num_test', type=click.IntRange(min=1), default=1000,
              show_default=True, help='Records in test_batch.bin.')
@click.option('--seed', type=int, default=0, show_default=True)
@_force_option
def synth(data_dir, train_per_file, num_test, seed, force):
  """Generate learnable CIFAR-format data (works offline)."""
  replacing = _replacing(data_dir, 'synth', force)
  from cifar10_towers.common import cifar10_format as fmt
  from cifar10_towers.common import progress as progress_lib
  from cifar10_towers.common import synth as synth_lib
  # CIFAR-10's size takes ~10 s: a bar over the files, or a line for each.
  with progress_lib.Progress(len(fmt.TRAIN_FILES + fmt.EVAL_FILES),
                             'Generating', 'files') as progress:
    counts = synth_lib.generate(
        data_dir, train_per_file=train_per_file, num_test=num_test, seed=seed,
        progress=lambda name, number, count: progress.stage(
            number - 1, 'Generating %s (%d of %d)...' % (name, number, count),
            name))
    progress.update(progress.total)
  _say_written(counts, 'synth', data_dir, replacing)


@data.command()
@_data_dir_option
def download(data_dir):
  """Download and unpack CIFAR-10 (sha256-verified); skipped when present."""
  result = _download(data_dir)
  click.echo('CIFAR-10 in %s: %s.' % (data_dir, result.replace('_', ' ')))


@data.command()
@_data_dir_option
def check(data_dir):
  """Validate every data file and report all problems at once."""
  from cifar10_towers.common import cifar10_format as fmt
  from cifar10_towers.common import generated
  problems, counts = fmt.check_data_dir(data_dir)
  marker = generated.read(data_dir)
  for name, count in counts.items():
    click.echo('%s: %d records, ok' % (name, count))
  if problems:
    for problem in problems:
      logger.warning(problem)
    if marker is not None:
      again = generated.command(marker)
      raise click.ClickException(
          '%d problem(s) in %s (%s). Regenerate it (`%s`).'
          % (len(problems), data_dir, generated.describe(marker),
             again or prog.command('data %s --data_dir %s'
                                   % (marker['generator'], data_dir))))
    raise click.ClickException(
        '%d problem(s) in %s. Re-download (`%s`) or regenerate (`%s`).'
        % (len(problems), data_dir, prog.command('data download'),
           prog.command('data synth --force')))
  if marker is not None:
    click.echo('%s: all %d files are valid %s, not CIFAR-10.'
               % (data_dir, len(counts), generated.describe(marker)))
  else:
    click.echo('%s: all %d files are valid.' % (data_dir, len(counts)))


@data.command()
@_data_dir_option
@click.option('--seed', type=int, default=0, show_default=True)
@_force_option
def digits(data_dir, seed, force):
  """Convert scikit-learn's bundled handwritten digits (a real image set) to CIFAR format."""
  replacing = _replacing(data_dir, 'digits', force)
  click.echo('Converting scikit-learn\'s digits to CIFAR format in %s...' % data_dir)
  from cifar10_towers.common import digits as digits_lib
  try:
    counts = digits_lib.convert_digits(data_dir, seed=seed)
  except ImportError as e:
    raise click.ClickException(_first_line(e)) from None
  _say_written(counts, 'digits', data_dir, replacing)


_stopped_by_signal = False  # see _Group.invoke


def main():
  from cifar10_towers.common import ending  # pylint: disable=import-outside-toplevel
  from cifar10_towers.common import stderr_filter  # pylint: disable=import-outside-toplevel
  stderr_filter.install()  # before TensorFlow is imported: its noise never shows
  try:
    cli()  # pylint: disable=no-value-for-parameter
  except SystemExit as e:
    if _stopped_by_signal:
      ending.exit_now(e.code if isinstance(e.code, int) else 1)
    raise


if __name__ == '__main__':
  main()
