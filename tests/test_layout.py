"""The project's import graph: public TensorFlow only, and no import cycles.

Reads every module's source (no import), walks its AST for `import` and
`from ... import` statements anywhere in the file (function-level imports
included: a lazy import still makes a cycle), and checks the whole graph.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = 'cifar10_towers'
# Directory in the checkout -> the package it installs as (pyproject.toml).
DIRECTORIES = {PACKAGE: PACKAGE, 'common': 'cifar10_towers.common',
               'runtime': 'cifar10_towers.runtime', 'datasets': 'cifar10_towers.datasets',
               'legacy': 'cifar10_towers.legacy',
               'modern': 'cifar10_towers.modern',
               'towerprofile': 'cifar10_towers.towerprofile'}
PACKAGES = tuple(DIRECTORIES.values())
# Names the project's modules had before they moved into one namespace; an
# import of one of them would load a second copy of a module from a checkout.
BARE_NAMES = ('common', 'runtime', 'datasets', 'legacy', 'modern', 'towerprofile', 'cli',
              'bench', 'convert', 'crosscheck')


def _short(module):
  """'cifar10_towers.modern.train' -> 'modern.train', as the asserts read."""
  return module[len(PACKAGE) + 1:] if module.startswith(PACKAGE + '.') else module


def _modules():
  """Dict module name ('modern.train', 'cli') -> path of the project's source.

  Names are relative to cifar10_towers; the checkout's thin `cli.py` entry
  file is 'cli.py', the script.
  """
  found = {'cli.py': os.path.join(ROOT, 'cli.py')}
  for directory, package in DIRECTORIES.items():
    for name in sorted(os.listdir(os.path.join(ROOT, directory))):
      if name.endswith('.py'):
        module = package if name == '__init__.py' else '%s.%s' % (package, name[:-3])
        found[_short(module)] = os.path.join(ROOT, directory, name)
  return found


def _imports(path):
  """Every module name an import statement of the file names."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names.extend(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.append(node.module)
      # `from cifar10_towers.modern import train` imports the module modern.train.
      names.extend('%s.%s' % (node.module, alias.name) for alias in node.names)
  return names


def _project_graph():
  """Dict module -> sorted project modules it imports (packages' __init__ left out)."""
  modules = _modules()
  graph = {}
  for module, path in modules.items():
    graph[module] = sorted({_short(name) for name in _imports(path)
                            if _short(name) in modules and name not in PACKAGES
                            and _short(name) != module})
  return graph


def _cycle(graph):
  """One import cycle as a list of modules [a, b, ..., a], or None."""
  state = {}  # module -> 'open' while on the DFS stack, 'done' after
  stack = []

  def visit(module):
    state[module] = 'open'
    stack.append(module)
    for target in graph.get(module, ()):
      if state.get(target) == 'open':
        return stack[stack.index(target):] + [target]
      if target not in state:
        found = visit(target)
        if found:
          return found
    stack.pop()
    state[module] = 'done'
    return None

  for module in sorted(graph):
    if module not in state:
      found = visit(module)
      if found:
        return found
  return None


def test_the_walk_sees_imports():
  # A test that cannot fail is a defect: the walk must find known edges.
  graph = _project_graph()
  assert 'common.model_spec' in graph['modern.model']
  assert 'modern.checkpoints' in graph['modern.train']
  assert _cycle({'a': ['b'], 'b': ['c'], 'c': ['a']}) == ['a', 'b', 'c', 'a']
  assert _cycle({'a': ['b'], 'b': []}) is None


def test_every_project_import_goes_through_the_namespace():
  # tests/ included: a bare `from common import x` would still work from a
  # checkout (its root is on sys.path) and load a second copy of the module.
  paths = dict(_modules())
  tests = os.path.join(ROOT, 'tests')
  paths.update(('tests/' + name, os.path.join(tests, name))
               for name in os.listdir(tests) if name.endswith('.py'))
  bare = {module: [name for name in _imports(path)
                   if name.split('.')[0] in BARE_NAMES]
          for module, path in paths.items()}
  assert {module: names for module, names in bare.items() if names} == {}
  assert _imports(paths['cli.py']) == ['cifar10_towers.cli',
                                       'cifar10_towers.cli.main']


def test_no_module_imports_private_tensorflow():
  private = {module: [name for name in _imports(path)
                      if name.startswith(('tensorflow.python',
                                          'tensorflow.compiler'))]
             for module, path in _modules().items()}
  assert {module: names for module, names in private.items() if names} == {}


def test_no_import_cycles():
  assert _cycle(_project_graph()) is None


def test_layers_point_one_way():
  """cli -> crosscheck/convert/bench -> legacy, modern -> runtime, datasets -> common.

  common/ is the contract both trainers agree on: it imports nothing else of
  the project; runtime/ (run machinery) and datasets/ (data tools) import
  common/ and each other, never a trainer or a command.
  """
  graph = _project_graph()
  for module, targets in graph.items():
    if module.startswith('common'):
      assert not [t for t in targets if not t.startswith('common')], module
    if module.startswith(('runtime', 'datasets')):
      assert not [t for t in targets
                  if not t.startswith(('common', 'runtime', 'datasets'))], module
    if module.startswith('legacy'):
      assert not [t for t in targets if t.startswith('modern')], module
    if module.startswith('modern'):
      assert not [t for t in targets if t.startswith('legacy')], module
    if module not in ('cli', 'cli.py'):
      assert 'cli' not in targets, module
