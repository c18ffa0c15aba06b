"""cifar10-towers: train, evaluate and cross-check the CIFAR-10 multi-GPU trainers.

TensorFlow is imported inside the commands, so `python cli.py --help` is instant.
Progress and metrics go to stdout, diagnostics to stderr.
"""

import atexit
import dataclasses
import functools
import importlib
import logging
import os
import signal
import sys
import traceback

import click

# Keep TensorFlow's start-up chatter and tf.compat.v1 deprecation notices off
# the terminal unless asked for (TF_CPP_MIN_LOG_LEVEL=0 brings them back).
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
if os.environ['TF_CPP_MIN_LOG_LEVEL'] != '0':
  logging.getLogger('tensorflow').setLevel(logging.ERROR)

# No TensorFlow (nor numpy) behind these: `--help` stays instant.
# pylint: disable=wrong-import-position
from cifar10_towers.common import devices
from cifar10_towers.common import errors
from cifar10_towers.common import hparams
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.common import prog
from cifar10_towers.common import version
from cifar10_towers.modern import cluster  # no TensorFlow: usage errors come at once
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import ending
from cifar10_towers.runtime import progress
from cifar10_towers.runtime import stderr_filter
from cifar10_towers.runtime import training
# pylint: enable=wrong-import-position

logger = logging.getLogger(__name__)


class _Path(click.Path):
  """click.Path, the type of every path option: an empty path is a usage error (exit 2)
  naming the flag, and so is an output path (output=True) that cannot be written.

  An output directory (dir_okay) must be writable or creatable; an output
  file's directory must be there and writable. Checked as the command line
  is parsed, before any work: a long run never finds out at its end.
  """

  def __init__(self, output=False, **settings):
    super().__init__(**settings)
    self.output = output

  def convert(self, value, param, ctx):
    # '' is no path to os.path and open(), and the working directory to TensorFlow.
    why = 'an empty path'
    if value:
      value = super().convert(value, param, ctx)
      why = self.output and _cannot_write(
          value if self.dir_okay else os.path.dirname(value) or '.', create=self.dir_okay)
    if why:
      flag = param.opts[0]
      raise click.BadParameter(f'{why}; pass another {flag}.', ctx, param_hint=flag)
    return value


# The options' types: closed ranges, and directories or files.
_POSITIVE = click.IntRange(min=1)
_NON_NEGATIVE = click.IntRange(min=0)
_POSITIVE_FLOAT = click.FloatRange(min=0.0, min_open=True)
_TOWERS = click.IntRange(1, devices.MAX_TOWERS)
_DIR = _Path(file_okay=False)  # one read from
_OUT_DIR = _Path(output=True)  # one written to (created if missing)
_OUT_FILE = _Path(output=True, dir_okay=False)
_IMPLS = ('legacy', 'modern')  # the trainers


def _configure_logging():
  """What the library says (loggers under cifar10_towers) goes to the CLI's one handler, once.

  runtime.progress.LogHandler: progress and metrics (below WARNING) to stdout,
  diagnostics to stderr, each line as it was said.
  """
  package = logging.getLogger('cifar10_towers')
  if not any(isinstance(h, progress.LogHandler) for h in package.handlers):
    package.addHandler(progress.LogHandler())
  package.setLevel(logging.INFO)
  package.propagate = False  # said once, not again by a handler of the root logger


def _option(flags, type_, default, help_text=None, **settings):
  """click.option(*flags.split(), type=type_, default=default, help=help_text, **settings).

  flags: the option ('--out'), then its parameter's name where that differs
  ('--out out_dir'). type_ bool makes a flag (is_flag), off by default.
  """
  return click.option(*flags.split(), type=type_, default=default, help=help_text,
                      is_flag=type_ is bool, **settings)


def _options(*options):
  """One decorator adding click.option decorators, listed in --help's order."""
  return lambda f: functools.reduce(lambda g, option: option(g), reversed(options), f)


def _data_dir(help_text, default=config_lib.DEFAULT_DATA_DIR, envvar='CIFAR10_DATA_DIR'):
  return _option('--data_dir', _DIR, default, help_text, envvar=envvar)


def _batch_size(help_text, default=hparams.BATCH_SIZE):
  return _option('--batch_size', _POSITIVE, default, help_text)


def _given(*names):
  """Those of the current command's parameters `names` that the user set."""
  source = click.get_current_context().get_parameter_source
  return [name for name in names if source(name) != click.core.ParameterSource.DEFAULT]


def _cannot_write(directory, create=True):
  """Why `directory` can be neither written nor created (create False: it must be
  there), in words; None if it can."""
  probe = directory  # it, or its nearest ancestor that exists ('.' at the top)
  while not os.path.exists(probe):
    if not create:
      return f'{directory} does not exist'
    probe = os.path.dirname(probe) or '.'
  if not os.path.isdir(probe):
    why = 'not a directory' if probe == directory else f'so {directory} cannot be created under it'
    return f'{probe} is a file, {why}'
  if not os.access(probe, os.W_OK | os.X_OK):
    return f'{probe} is not writable'



def _ensure_train_data(data_dir):
  """Finds the training data, downloading CIFAR-10 when it is missing (as upstream did).

  Does nothing for data_dir None: generated data (crosscheck, profile).
  """
  if data_dir is None:
    return
  from cifar10_towers.common import cifar10_format as fmt
  # Like upstream, download only when cifar-10-batches-bin/ is not there at
  # all: a download into a partial directory would replace the files in it.
  if not os.path.isdir(fmt.batches_dir(data_dir)):
    _download(data_dir)
  # Fail before building a graph on sizes and label bytes; say which files
  # cannot be real data (all one image, one label, copies), and go on.
  check = prog.command('data check', data_dir=data_dir)
  fmt.checked_files(data_dir, True, f'training goes on (`{check}` lists every problem).')


def _download(data_dir):
  """Downloads and unpacks CIFAR-10 unless it is there, with a bar on stderr once it begins."""
  from cifar10_towers.datasets import download
  url = os.environ.get('CIFAR10_DATA_URL', download.DATA_URL)
  bar = click.progressbar(length=download.ARCHIVE_BYTES, label=f'Downloading {url}',
                          file=sys.stderr)
  try:
    return download.maybe_download_and_extract(
        data_dir, url=url, sha256=download.ARCHIVE_SHA256,
        progress=lambda done, total: bar.update(done - bar.pos))
  finally:
    if bar.pos:  # drawn: end its line
      bar.render_finish()


# The original's flags, shared by `legacy` and `modern` so they mean the same.
_TRAIN_OPTIONS = _options(
    _option('--num_gpus', _TOWERS, 1, 'Number of towers, one per GPU; with fewer GPUs the '
            'CPU is split into this many logical devices.'),
    _data_dir('Directory holding cifar-10-batches-bin/ (env CIFAR10_DATA_DIR).'),
    _option('--train_dir', _OUT_DIR, config_lib.DEFAULT_TRAIN_DIR,
            'Where checkpoints and summaries go; a run resumes from the newest checkpoint '
            'here (env CIFAR10_TRAIN_DIR).', envvar='CIFAR10_TRAIN_DIR'),
    _batch_size('Images per tower per step.'),
    _option('--max_steps', _NON_NEGATIVE, 1000000, 'Train until the global step reaches this.'),
    _option('--log_every', _POSITIVE, 10, 'Steps between log lines.'),
    _option('--summary_every', _POSITIVE, 100, 'Steps between TensorBoard summaries.'),
    _option('--save_every', _POSITIVE, 1000, 'Steps between checkpoints; one is also written '
            'at the end and on Ctrl-C.'),
    _option('--log_device_placement', bool, False, 'Print the device of every op.'),
    _option('--seed', int, None,
            'Random seed for initialization and input; unset means nondeterministic.'),
    _option('--crosscheck run_crosscheck', bool, False, 'Before training, prove on batches '
            'of --data_dir (16 images per tower) that legacy and modern compute the same '
            'averaged gradients.'),
)

# The update rule, shared by `legacy`, `modern` and `crosscheck` (common.optimizer);
# each option's parameter is named for its field of common.optimizer.OptimizerSpec.
_DEFAULT_OPTIMIZER = optimizer_lib.OptimizerSpec()
_BETA = click.FloatRange(0.0, 1.0, max_open=True)
_OPTIMIZER_OPTIONS = _options(
    _option('--optimizer name', click.Choice(optimizer_lib.NAMES), _DEFAULT_OPTIMIZER.name,
            'sgd: upstream\'s plain gradient descent; momentum and adam: TF1\'s '
            'MomentumOptimizer and AdamOptimizer (both trainers compute the same update). '
            'The learning rate follows upstream\'s staircase decay in all three.'),
    _option('--learning_rate', _POSITIVE_FLOAT, _DEFAULT_OPTIMIZER.learning_rate,
            'Initial learning rate (upstream\'s 0.1; Adam wants about 0.001).'),
    _option('--momentum', click.FloatRange(min=0.0), _DEFAULT_OPTIMIZER.momentum,
            '--optimizer momentum: accum = momentum * accum + grad.'),
    _option('--adam_beta1', _BETA, _DEFAULT_OPTIMIZER.adam_beta1,
            '--optimizer adam: decay of the first moment.'),
    _option('--adam_beta2', _BETA, _DEFAULT_OPTIMIZER.adam_beta2,
            '--optimizer adam: decay of the second moment.'),
    _option('--adam_epsilon', _POSITIVE_FLOAT, _DEFAULT_OPTIMIZER.adam_epsilon,
            '--optimizer adam: added to sqrt(v).'),
    _option('--clip_norm', _POSITIVE_FLOAT, None, 'Clip the gradients to this global norm '
            '(tf.clip_by_global_norm); default: no clipping.'),
    _option('--clip_where', click.Choice(optimizer_lib.CLIP_WHERE), _DEFAULT_OPTIMIZER.clip_where,
            'averaged: clip the towers\' mean gradient; per_tower: clip each tower\'s before '
            'the mean, which is NOT the same as one tower on all the images (README).'),
)


def _optimizer_from(options):
  """Pops the optimizer flags from a command's options: common.optimizer.OptimizerSpec.

  A flag that the chosen optimizer ignores is a usage error (exit 2), so a
  typo such as `--adam_beta1` with `--optimizer momentum` is not lost.
  """
  optimizer = optimizer_lib.OptimizerSpec(**{
      field.name: options.pop(field.name) for field in dataclasses.fields(optimizer_lib.OptimizerSpec)})
  for name in _given('momentum', 'adam_beta1', 'adam_beta2', 'adam_epsilon'):
    needs = name.split('_')[0]  # momentum, or adam for the adam_* flags
    if optimizer.name != needs:
      raise click.UsageError(f'--{name} is for --optimizer {needs} (this run has --optimizer '
                             f'{optimizer.name}).')
  if _given('clip_where') and optimizer.clip_norm is None:
    raise click.UsageError('--clip_where needs --clip_norm.')
  return optimizer


def _train(impl, run_crosscheck, **options):
  """`legacy` and `modern`: checks what it can before TensorFlow, then trains."""
  optimizer = _optimizer_from(options)
  done = [None]  # the last global step this run completed
  try:
    # Until the first step nothing is written, so there a stop ends the run at
    # once (training.Stopped, which _Group.invoke reports).
    with click.get_current_context().obj.raising():
      if impl == 'modern':
        _check_distribution(run_crosscheck=run_crosscheck, **options)
      config = config_lib.TrainConfig(optimizer=optimizer, **options)
      _ensure_train_data(config.data_dir)
      _say_if_generated(config.data_dir, 'Training')
      plan = devices.plan_devices(config.num_gpus)
      from cifar10_towers.runtime import memory  # refuse what cannot fit, before building
      memory.check_training(impl, plan, config.batch_size, config.data_dir)
      if run_crosscheck:
        # At crosscheck's own batch (16), not --batch_size: cheaper, and on an
        # H100 cuDNN's conv2 filter gradient at batch 128 is 1e-2 from float64's
        # (docs/equivalence.md §3), which the N-tower identity cannot survive.
        _crosscheck(plan, optimizer, config.strategy, seed=config.seed or 0,
                    data_dir=config.data_dir)
      trainer = importlib.import_module(f'cifar10_towers.{impl}.train')
    trainer.train(config, plan, on_step=lambda step, *_: done.__setitem__(0, step))
  # Not a step's line (the loop's ending.failed said what it kept): before the first step or
  # after the last (the run's final line).
  except progress.StreamClosed as e:
    raise ending.RunFailed(
        f'{e} before the first step; nothing was saved.' if done[0] is None else
        f"{e} after the last step; saved global step {done[0]} in {options['train_dir']}.") from e
  finally:
    progress.end_line()


_COMMAND = 'cifar10_towers.command'  # ctx.meta key of the command's name ('data synth')


class _Group(click.Group):
  """The one place where a command of this CLI ends: a failure, a stop signal.

  A common.errors.Failure (what a user did wrong or the world did to a
  run) is said in its one line, with its exit code (a closed stream,
  runtime.progress.StreamClosed, with what the command left); an OSError as
  the path problem it is. Anything else is a bug: its traceback shows.

  A StopRequest is held around every command (runtime.training.STOP_SIGNALS).
  A stop before a loop's first step, or in a command without a loop, raises
  training.Stopped, which ends here with one line; a loop that stopped at a
  boundary has said what it kept. Either way the exit status is 128 + the
  signal's number, as if killed by it, so `train && eval` stops there.
  """

  def invoke(self, ctx):
    stop = ctx.obj = ctx.with_resource(training.StopRequest())  # every command's ctx.obj
    try:
      super().invoke(ctx)  # `cli` below enters stop.raising() where it applies
    except (errors.Failure, OSError) as e:
      # CIFAR10_TOWERS_DEBUG=1: the whole story, the traceback and its causes,
      # before the one line; otherwise no TensorFlow op, node block or traceback.
      if os.environ.get('CIFAR10_TOWERS_DEBUG') == '1':
        traceback.print_exception(e)
      # A user's or the world's error: its line, its exit code; an OSError: the path it names.
      line = ending.cause(e)
      if isinstance(e, progress.StreamClosed):  # not training's: _train says what it kept
        line += (f'; `{ctx.meta.get(_COMMAND)}` did not finish, and left nothing '
                 'half-written.')
      elif isinstance(e, OSError):
        line += '. Check the path and its permissions.'
      raise (click.UsageError if getattr(e, 'exit_code', 1) == 2 else click.ClickException)(
          line) from None
    except (training.Stopped, Exception) as e:  # pylint: disable=broad-except
      # Once a stop was requested, any other error is that stop: Python can
      # replace the Stopped a signal raised with another exception (inside
      # `from m import name`, CPython's "TypeError: expected a message argument").
      if not (isinstance(e, training.Stopped) or stop.requested):
        raise
      name, command = getattr(e, 'signal_name', stop.signal_name), ctx.meta.get(_COMMAND)
      ending.say(str(training.Stopped(name)) if command in _IMPLS
                 else f'Stopped by {name}; `{command}` did not finish, and left nothing '
                 'half-written.')
    if stop.requested:
      ctx.exit(training.exit_status(stop.signal_name))


@click.group(cls=_Group, context_settings={'help_option_names': ['-h', '--help'],
                                           'show_default': True})
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
  # Commands that own a loop answer a stop at its boundaries, saying what they
  # kept; every other command ends at once (training.Stopped), its writers
  # leaving nothing half-written.
  if ctx.invoked_subcommand not in (*_IMPLS, 'eval'):
    ctx.with_resource(ctx.obj.raising())


@cli.command()
@_TRAIN_OPTIONS
@_OPTIMIZER_OPTIONS
def legacy(**options):
  """Train with the original queue-runner multi-tower trainer (tf.compat.v1)."""
  _train('legacy', **options)


def _parse_worker_hosts(ctx, param, value):  # pylint: disable=unused-argument
  if not value:
    return ()
  try:
    return cluster.parse_worker_hosts(value)
  except cluster.ClusterError as e:
    raise click.BadParameter(e.line()) from None


def _check_distribution(num_gpus, strategy, worker_hosts, task_index, run_crosscheck,
                        **unused):
  """Bad combinations of the strategy flags are usage errors (exit 2)."""
  given = _given('worker_hosts', 'task_index', 'startup_timeout')
  if strategy != 'multiworker':
    if given:
      raise click.UsageError(f'--{given[0]} is for --strategy multiworker.')
    return
  if run_crosscheck:
    raise click.UsageError(f'--crosscheck runs in one process; run `{prog.command("crosscheck")}` '
                           'before a --strategy multiworker run.')
  if 'task_index' in given and not worker_hosts:
    raise click.UsageError('--task_index needs --worker_hosts (or set TF_CONFIG '
                           'instead of both).')
  try:  # also: --task_index is an index of --worker_hosts
    cluster.resolve_cluster(worker_hosts, task_index)
  except cluster.ClusterError as e:
    raise click.UsageError(e.line()) from None
  if num_gpus == 1:
    return
  # A replica per GPU, or one on a CPU-only machine.
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  found = len(tf.config.list_physical_devices('GPU'))
  if found < num_gpus:
    raise click.UsageError(
        '--strategy multiworker runs one replica per GPU, and this machine has '
        f'{found} GPU(s) for --num_gpus {num_gpus}; on CPUs TensorFlow runs one replica per '
        'worker: pass --num_gpus 1 and start more workers.')


@cli.command()
@_TRAIN_OPTIONS
@_OPTIMIZER_OPTIONS
# How `modern` spreads the step: its own towers, or a tf.distribute engine.
@_option('--strategy', click.Choice(config_lib.STRATEGIES), 'towers',
         'towers: one tf.function tower per device; mirrored: tf.distribute.MirroredStrategy '
         'over the same devices; multiworker: MultiWorkerMirroredStrategy, --num_gpus replicas '
         '(GPUs; 1 on a CPU-only machine) on each of several workers (TF_CONFIG, or '
         '--worker_hosts and --task_index).')
@_option('--worker_hosts', None, None,
         'Every worker of a multiworker run, the same list on each; instead of TF_CONFIG.',
         metavar='HOST:PORT,...', callback=_parse_worker_hosts)
@_option('--task_index', _NON_NEGATIVE, 0, 'This worker\'s index in --worker_hosts; 0 is the '
         'chief, which writes checkpoints and logs.')
@_option('--peer_timeout', _POSITIVE, config_lib.TrainConfig.peer_timeout,
         'Seconds a multiworker step waits for the other workers; then the worker stops with '
         'an error instead of hanging.')
@_option('--startup_timeout', _POSITIVE, config_lib.TrainConfig.startup_timeout,
         'Seconds a multiworker worker waits for the others to start; then it stops with an '
         'error naming those that did not answer.')
def modern(**options):
  """Train with the TF2 rewrite: tf.data input, one tf.function tower per device."""
  _train('modern', **options)


@cli.command(name='eval')
@_option('--checkpoint_dir', _DIR, config_lib.DEFAULT_TRAIN_DIR,
         'A train_dir of either trainer (env CIFAR10_TRAIN_DIR).', envvar='CIFAR10_TRAIN_DIR')
@_data_dir('Directory holding cifar-10-batches-bin/.')
@_option('--num_examples', _POSITIVE, None,
         'Evaluate the first N test records; default all of them.')
@_batch_size('Images per evaluation batch.')
@_option('--run_once', bool, False,
         'Evaluate the newest checkpoint and exit, instead of waiting for new ones.')
@_option('--eval_interval_secs', _POSITIVE, 300, 'How often to look for a new checkpoint.')
@_option('--eval_dir', _Path(), None,
         'Where precision @ 1 goes for TensorBoard (tag "Precision @ 1", at each checkpoint\'s '
         'global step); created if missing, its event files kept (env CIFAR10_EVAL_DIR). '
         'Default: <checkpoint_dir>/eval, so `tensorboard --logdir <checkpoint_dir>` shows '
         f'training and precision together; {config_lib.DEFAULT_EVAL_DIR} if the checkpoint_dir '
         'cannot be written.', envvar='CIFAR10_EVAL_DIR')
@click.pass_obj
def eval_command(stop, checkpoint_dir, data_dir, num_examples, batch_size, run_once,
                 eval_interval_secs, eval_dir):
  """Print precision @ 1 on the test set with the moving-average weights.

  Evaluates the newest intact checkpoint (saying which it skipped, and why),
  then, without --run_once, each new one as training writes it, until Ctrl-C.
  Each precision also goes to --eval_dir for TensorBoard.
  """
  # A signal while TensorFlow loads or a batch runs is a request to `stop`
  # (_Group), answered with one line and 128 + its number.
  from cifar10_towers.common import cifar10_format as fmt
  from cifar10_towers.runtime import evaluation
  num_records = fmt.num_examples(
      fmt.checked_files(data_dir, False, 'a precision measured on it means nothing.'))
  _say_if_generated(data_dir, 'Evaluating')
  if (num_examples or 0) > num_records:
    logger.warning(f'--num_examples {num_examples} is more than the {num_records} records of '
                   f'the test set in {data_dir}; evaluating all {num_records}.')
  elif num_examples:
    num_records = num_examples
  if eval_dir is None:
    # Deviation from upstream: eval's summaries go under the train_dir it
    # evaluates, so `tensorboard --logdir TRAIN_DIR` shows a run's training and
    # precision together; upstream's /tmp/cifar10_eval where the train_dir
    # cannot be written (a read-only copy), said in one line.
    eval_dir = os.path.join(checkpoint_dir, config_lib.EVAL_SUBDIR)
    if _cannot_write(eval_dir):
      logger.warning(f'{checkpoint_dir} cannot be written; precision @ 1 goes to '
                     f'{config_lib.DEFAULT_EVAL_DIR} for TensorBoard (pass --eval_dir to choose).')
      eval_dir = config_lib.DEFAULT_EVAL_DIR

  def evaluate(contents, should_stop):
    """What `runtime.evaluation.run` calls: each checkpoint by its own trainer's evaluator.

    Chosen per checkpoint, not once: one train_dir can hold either trainer's
    checkpoints over time. legacy/ and modern/ never import each other; the
    dispatch is here. Each evaluation shows its progress over the num_records
    test records (`runtime.progress`): a bar on a terminal, else a line as it
    begins and a few more if it is slow.
    """
    name = os.path.basename(contents.path)
    with progress.Progress(num_records, f'Evaluating {name}', 'records') as shown:
      shown.stage(0, f'Evaluating {name} on {num_records} test records...')
      evaluator = importlib.import_module(f'cifar10_towers.{contents.kind}.eval')
      return evaluator.evaluate_contents(contents, data_dir, batch_size, num_examples,
                                         should_stop, progress=shown.update)

  evaluation.run(checkpoint_dir, evaluate, stop,
                 interval_secs=None if run_once else eval_interval_secs, eval_dir=eval_dir)


def _crosscheck(plan, optimizer, strategy, dump=None, rtol=None, **run_args):
  """Runs the cross-check, prints its tables; ClickException (exit 1) if it fails.

  run_args: crosscheck.run's batch_size, steps, seed, data_dir, decay_steps.
  """
  from cifar10_towers import crosscheck as crosscheck_lib
  engines = ('towers', 'mirrored') if strategy == 'mirrored' else ('towers',)
  if rtol is not None:  # else the contract's
    run_args['grad_rtol'] = rtol
  reports, images, labels, init = crosscheck_lib.run(
      plan, engines=engines, optimizer=optimizer, **run_args)
  for engine, report in reports.items():
    progress.echo(f'legacy vs modern ({engine}):\n{crosscheck_lib.format_report(report)}')
  if dump:
    path = crosscheck_lib.write_evidence(dump, images, labels, init, reports)
    progress.echo(f'Evidence written to {path}.')
  failed = [engine for engine, report in reports.items() if not report.passed]
  if not failed:
    return
  failures = [row for report in reports.values() for row in report.failures()]
  if all(' identity ' in row.check for row in failures):
    why = ('legacy and modern agree, but in both N towers differ from 1 tower on their images; '
           'on a GPU, cuDNN\'s arithmetic changes with the batch (docs/equivalence.md §3): '
           'try another --batch_size.')
  elif max(row.measured / row.tolerance for row in failures) < 10:
    # A bias gradient sums batch x 24 x 24 float32 terms, in an order each
    # graph picks: at --batch_size 3072 its rounding alone passed 1e-5.
    why = ('legacy and modern differ by less than 10x the tolerance, which float32 rounding '
           'of a large batch\'s sums can do (docs/equivalence.md §3): run a smaller '
           '--batch_size to tell rounding from a different computation.')
  else:
    why = 'legacy and modern do not compute the same thing.'
  raise click.ClickException(
      f'cross-check failed for legacy vs {" and ".join(failed)} (rows marked FAIL above): {why}')


# `crosscheck` and `profile`: N towers, two by default.
_NUM_TOWERS_N = _option('--num_gpus', _TOWERS, 2, 'Number of towers N.')


@cli.command()
@_NUM_TOWERS_N
@_batch_size('Images per tower.', default=16)
@_option('--steps', _NON_NEGATIVE, 5,
         'Training steps K, each compared from the same state in both trainers.')
@_option('--seed', int, 0, 'Seeds the batches and the initial variables.')
@_option('--seeds', _POSITIVE, 1, 'Check seeds --seed, --seed + 1, ... (a sweep: both trainers '
         'built once), a line each, then each figure at its worst seed.')
@_data_dir('Draw the batches from this data dir; default: generated data.', None, None)
@_option('--decay_steps', _POSITIVE, 2,
         'Learning-rate decay interval, small so K steps cross the staircase.')
@_option('--dump', _OUT_DIR, None,
         'Write the evidence file DIR/crosscheck.npz (docs/equivalence.md §2).')
@_option('--rtol', click.FloatRange(min=0.0), None, 'Tolerance of the averaged-gradient and '
         'identity checks [default: 1e-5, the contract].')
@_option('--strategy', click.Choice(['towers', 'mirrored']), 'towers', 'mirrored also '
         'compares tf.distribute.MirroredStrategy with legacy (3-way: legacy, towers, mirrored).')
@_OPTIMIZER_OPTIONS
def crosscheck(num_gpus, strategy, **options):
  """Prove legacy and modern compute the same averaged gradients (docs/equivalence.md §2).

  Builds both trainers, feeds both the same N tower batches, starts each of K
  steps in both from the same state, and compares at every step the averaged
  gradients, the tower losses and the step's update of every variable, moving
  average and optimizer slot; then the N-towers-vs-1 identity. Exits 0 when
  every figure is within the contract, 1 otherwise; a failed step's line says
  where the trainers part. The K steps' free-run drift is printed, not judged.
  """
  optimizer = _optimizer_from(options)
  _ensure_train_data(options['data_dir'])
  plan = devices.plan_devices(num_gpus)
  from cifar10_towers.runtime import memory  # refuse what cannot fit, before building
  # Legacy's estimate of a training step with no input queue: the trainers run
  # one after the other, each fed the batches as constants, so the peak is one
  # step's. On 1 CPU tower it was 1.27x, 1.08x, 1.05x the measured peak RSS at
  # batch 256, 1024, 3072: close above it, as training's (1.2-1.7x).
  memory.check_training('legacy', plan, options['batch_size'], None, 'the cross-check')
  if options['dump'] and options['seeds'] > 1:
    raise click.UsageError('--dump writes one seed\'s evidence; pass it without --seeds.')
  _crosscheck(plan, optimizer, strategy, **options)


@cli.command()
@click.argument('impl', type=click.Choice(_IMPLS))
@_NUM_TOWERS_N
@_batch_size('Images per tower.')
@_option('--steps', _POSITIVE, 10, 'Traced steps K, after a few untraced warm-up steps.')
@_data_dir('Directory holding cifar-10-batches-bin/; default: small generated data.', None)
@_option('--out out_dir', _OUT_DIR, 'profile_out',
         'Where trace.json (Perfetto, chrome://tracing), timeline.png '
         'and report.json go.')
@_option('--misplace_tower', _NON_NEGATIVE, None,
         'Demonstration: pin this tower to the variables\' device '
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
    raise click.BadParameter(f'must be below --num_gpus ({num_gpus}), got {misplace_tower}',
                             param_hint='--misplace_tower')
  _ensure_train_data(data_dir)
  plan = devices.plan_devices(num_gpus)  # before TensorFlow starts
  from cifar10_towers.runtime import memory  # refuse what cannot fit, before building
  memory.check_training(impl, plan, batch_size, data_dir)
  from cifar10_towers.towerprofile import run as profile_lib
  progress.echo(f'Profiling {steps} step(s) of {impl} on {num_gpus} tower(s) under TensorFlow\'s '
                'tracing...')
  report, written = profile_lib.profile(
      impl, plan, batch_size, steps, data_dir=data_dir, out_dir=out_dir,
      misplace_tower=misplace_tower)
  progress.echo('\n'.join(profile_lib.format_report(report)))
  for name, path in sorted(written.items()):
    progress.echo(f'Wrote {path} ({name}).')


@cli.command()
@_option('--from_dir', _Path(exists=True, file_okay=False), None,
         'A train_dir of either trainer; its newest checkpoint is converted.', required=True)
@_option('--to_dir', _OUT_DIR, None, 'A new or empty directory, outside --from_dir, for the other '
         'trainer\'s checkpoint.', required=True)
def convert(from_dir, to_dir):
  """Turn a legacy train_dir into a modern one, or back.

  Weights, moving averages, the global step and the optimizer's slots
  (momentum, Adam) move bit for bit; training continues from the converted
  checkpoint and eval gives the same precision.
  """
  progress.echo(f'Converting the newest checkpoint of {from_dir} into {to_dir}...')
  from cifar10_towers import convert as convert_lib
  convert_lib.convert(from_dir, to_dir)


def _comma_list(item_type):
  """A click callback: 'a,b' -> (a, b), each item once, each checked by the click type item_type."""
  return lambda ctx, param, value: tuple(dict.fromkeys(
      item_type.convert(item.strip(), param, ctx) for item in value.split(',')))


@cli.command()
@_option('--impl impls', None, 'legacy,modern', 'Trainers to measure, comma-separated.',
         callback=_comma_list(click.Choice(_IMPLS)))
@_option('--num_gpus', None, '1,2', 'Tower counts, comma-separated; without GPUs the CPU is '
         'split into that many logical devices.', callback=_comma_list(_TOWERS))
@_batch_size('Images per tower per step.')
@_data_dir('CIFAR-10 data to train on; default: generated data of CIFAR-10\'s size in a '
           'temporary directory.', None, None)
@_option('--rounds', _POSITIVE, 10, 'Timed rounds: one window of each contender (Keras, '
         'legacy, modern, ...) in turn; rates and ratios are medians over rounds.')
@_option('--warmup_rounds', _NON_NEGATIVE, 2, 'Rounds run first and not counted.')
@_option('--window_steps', _POSITIVE, 10, 'Training steps per window.')
@_option('--matmul_size', _POSITIVE, 4096,
         'Size n of the n x n fp32 matmuls measuring the matmul rate.')
@_option('--json json_path', _OUT_FILE, None, 'Also write the results to this JSON file.')
@_option('--jit', bool, False, 'Compile each tower\'s loss and gradients with XLA in both '
         'trainers (the Keras baseline keeps its default).')
@_option('--plot plot_path', _OUT_FILE, None, 'Also draw the results as a PNG bar chart (needs '
         'matplotlib: pip install matplotlib, or the [profile] extra).')
@_option('--from_json', _Path(exists=True, dir_okay=False), None, 'Measure nothing: read '
         'the results of an earlier --json run, print its table and draw it with --plot.')
@click.pass_context
def bench(ctx, json_path, plot_path, from_json, **options):
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
             if p.name not in ('plot_path', 'from_json') and _given(p.name)]
    if given:
      raise click.UsageError('--from_json draws results measured earlier; it takes '
                             f'only --plot, not {", ".join(given)}.')
    report = bench_lib.read_json(from_json)
  else:
    if plot_path:
      bench_lib.check_plotting()  # before minutes of measuring, not after
    _ensure_train_data(options['data_dir'])
    report = bench_lib.run(bench_lib.BenchConfig(**options))
  progress.echo(bench_lib.format_table(report))
  if json_path:  # never with --from_json
    bench_lib.write_json(report, json_path)
    progress.echo(f'Wrote {json_path}.')
  if plot_path:
    bench_lib.plot(report, plot_path)
    progress.echo(f'Wrote {plot_path}.')


@cli.group()
@click.pass_context
def data(ctx):
  """Get, generate or check CIFAR-10 data in the binary format."""
  ctx.meta[_COMMAND] = f'data {ctx.invoked_subcommand}'


_DATA_DIR = _data_dir('Directory that holds (or will hold) cifar-10-batches-bin/.')
_FORCE = _option('--force', bool, False, 'Also replace data this command did not write: '
                 'CIFAR-10, your own, or the other generator\'s.')
_SEED = _option('--seed', int, 0)


def _generate(data_dir, generator, force, write):
  """Runs write() for `data <generator>` and says what it wrote; refuses with exit 1.

  `data synth` and `data digits` treat what is there alike: each replaces its
  own kind of generated data, and anything else - data without a marker
  (CIFAR-10, a 170 MB download, or the user's own) or the other generator's
  data - only with --force. write() returns the records written per file.
  """
  from cifar10_towers.datasets import generated
  marker = generated.read(data_dir) or {
      'generator': None, 'what': 'data not marked as generated (CIFAR-10, or your own)'}
  own = marker['generator'] == generator
  replacing = ''
  if marker['generator'] or generated.holds_data(data_dir):
    if not (own or force):
      raise click.ClickException(
          f'{data_dir} holds {marker["what"]}; left it as it is. Pass --force to replace it '
          f'with generated data ({generator}), or pass another --data_dir.')
    forced = '' if own else ' (--force)'
    replacing = f', replacing the {marker["what"]} there{forced}'
  counts = write()
  test = counts.pop('test_batch.bin', 0)  # the others: training files
  progress.echo(f'Wrote {sum(counts.values())} training and {test} test records of generated data '
                f'({generator}) to {data_dir}{replacing}. It is not CIFAR-10 '
                f'({generated.CIFAR10_RESULT}).')


def _say_if_generated(data_dir, doing):
  """One line on stderr when data_dir holds generated data, not CIFAR-10."""
  from cifar10_towers.datasets import generated
  marker = generated.read(data_dir)
  if marker:
    logger.warning(f'{doing} on {marker["what"]} in {data_dir}, not on CIFAR-10 '
                   f'({generated.CIFAR10_RESULT}).')


@data.command()
@_DATA_DIR
@_option('--train_per_file', _POSITIVE, 1000, 'Records in each of the 5 training files.')
@_option('--num_test', _POSITIVE, 1000, 'Records in test_batch.bin.')
@_SEED
@_FORCE
def synth(data_dir, train_per_file, num_test, seed, force):
  """Generate learnable CIFAR-format data (works offline)."""

  def write():
    from cifar10_towers.common import cifar10_format as fmt
    from cifar10_towers.datasets import synth as synth_lib
    # CIFAR-10's size takes ~10 s: a bar over the files, or a line for each.
    with progress.Progress(len(fmt.DATA_FILES), 'Generating', 'files') as shown:
      counts = synth_lib.generate(
          data_dir, train_per_file=train_per_file, num_test=num_test, seed=seed,
          progress=lambda name, number, count: shown.stage(
              number - 1, f'Generating {name} ({number} of {count})...', name))
      shown.update(shown.total)
    return counts

  _generate(data_dir, 'synth', force, write)


@data.command()
@_DATA_DIR
def download(data_dir):
  """Download and unpack CIFAR-10 (sha256-verified); skipped when present."""
  result = _download(data_dir)
  progress.echo(f'CIFAR-10 in {data_dir}: {result.replace("_", " ")}.')


@data.command()
@_DATA_DIR
def check(data_dir):
  """Validate every data file and report all problems at once."""
  from cifar10_towers.common import cifar10_format as fmt
  from cifar10_towers.datasets import generated
  problems, counts = fmt.check_data_dir(data_dir)
  marker = generated.read(data_dir)
  for name, count in counts.items():
    progress.echo(f'{name}: {count} records, ok')
  for problem in problems:
    logger.warning(problem)
  if problems:
    kind = f' ({marker["what"]})' if marker else ''
    fix = (f'Regenerate it (`{marker["command"]}`)' if marker
           else f'Re-download (`{prog.command("data download")}`) or regenerate '
           f'(`{prog.command("data synth --force")}`)')
    raise click.ClickException(f'{len(problems)} problem(s) in {data_dir}{kind}. {fix}.')
  kind = f' {marker["what"]}, not CIFAR-10' if marker else ''
  progress.echo(f'{data_dir}: all {len(counts)} files are valid{kind}.')


@data.command()
@_DATA_DIR
@_SEED
@_FORCE
def digits(data_dir, seed, force):
  """Convert scikit-learn's bundled handwritten digits (a real image set) to CIFAR format."""

  def write():
    progress.echo(f'Converting scikit-learn\'s digits to CIFAR format in {data_dir}...')

    from cifar10_towers.datasets import digits as digits_lib
    return digits_lib.convert_digits(data_dir, seed=seed)

  _generate(data_dir, 'digits', force, write)


def main():
  stderr_filter.install()  # before TensorFlow is imported: its noise never shows
  try:
    cli()  # pylint: disable=no-value-for-parameter
  except SystemExit as e:
    status = e.code  # click's, an int: the command's, or 128 + N after a stop (_Group.invoke)
  # The command has ended: its result is kept, or its failure or stop said.
  # From here a stop signal ends the process at once with that status, not as
  # killed by the signal: a scheduler's grace is kept, and `convert && modern`
  # goes on. The atexit hooks run (TensorFlow's clean-up of its autograph temp
  # files, the stderr filter's flush); Python's interpreter teardown, in which
  # its signals are back at their default action, is skipped: with TensorFlow
  # loaded it takes 1-2 s, several times that on a busy machine, and a
  # scheduler's grace period (`docker stop`: 10 s) must be met.
  for sig in training.STOP_SIGNALS:
    if signal.getsignal(sig) != signal.SIG_IGN:  # nohup: it stays ignored
      signal.signal(sig, lambda *_: ending.exit_now(status))
  atexit._run_exitfuncs()  # pylint: disable=protected-access
  ending.exit_now(status)


if __name__ == '__main__':
  main()
