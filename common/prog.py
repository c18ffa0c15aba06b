"""The program's name as the user ran it, for the commands that messages suggest.

Installed, the command line is the console script `cifar10-towers` (setup.py's
entry point); from a checkout it is `python cli.py`. A hint must name the one
the user typed, or copying it fails. pip's console script runs with
sys.argv[0] = its own path, so its basename tells the two apart; anything
else (`python cli.py`, `python -m pytest`, click's test runner) is a checkout.
No TensorFlow here.
"""

import os
import shlex
import sys

CONSOLE_SCRIPT = 'cifar10-towers'  # setup.py: entry_points console_scripts
CHECKOUT = 'python cli.py'


def name(argv0=None):
  """'cifar10-towers' when run as the console script, else 'python cli.py'.

  Args:
    argv0: the program path to judge; default sys.argv[0].
  """
  if argv0 is None:
    argv0 = (sys.argv or [''])[0]
  # os.path.splitext: on Windows pip writes cifar10-towers.exe.
  base = os.path.splitext(os.path.basename(argv0))[0]
  return CONSOLE_SCRIPT if base == CONSOLE_SCRIPT else CHECKOUT


def command(args, **options):
  """`args` (a str such as 'data check'), then each of `options` as `--name value`,
  as the user would run it: each value quoted as a shell needs (shlex.quote), so
  a command with a path such as 'my runs' can be pasted as it is.

  Example: command('eval --run_once', checkpoint_dir='my run') is
  "python cli.py eval --run_once --checkpoint_dir 'my run'".
  """
  return f'{name()} {args}' + ''.join(f' --{flag} {shlex.quote(value)}'
                                     for flag, value in options.items())


def converted_dir(train_dir, to_kind):
  """Where a hint suggests converting train_dir to: `<train_dir>_<to_kind>`."""
  return f'{os.path.normpath(train_dir)}_{to_kind}'


def convert_command(train_dir, to_kind):
  """The exact `convert` command that turns train_dir into a `to_kind` one.

  For the trainers' errors on the other trainer's checkpoint: a command the
  user can copy as it is, into `converted_dir(train_dir, to_kind)`.

  Args:
    train_dir: str, the train_dir holding the other trainer's checkpoint.
    to_kind: 'legacy' or 'modern', the trainer that refused it.
  """
  return command('convert', from_dir=train_dir, to_dir=converted_dir(train_dir, to_kind))
