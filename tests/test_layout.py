"""The project's import graph: public TensorFlow only, and no import cycles.

Reads every module's source (no import), walks its AST for `import` and
`from ... import` statements anywhere in the file (function-level imports
included: a lazy import still makes a cycle), and checks the whole graph.
"""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('common', 'legacy', 'modern', 'towerprofile')


def _modules():
  """Dict module name ('modern.train', 'cli') -> path of the project's source."""
  found = {}
  for name in sorted(os.listdir(ROOT)):
    if name.endswith('.py') and name != 'setup.py':
      found[name[:-3]] = os.path.join(ROOT, name)
  for package in PACKAGES:
    directory = os.path.join(ROOT, package)
    for name in sorted(os.listdir(directory)):
      if name.endswith('.py'):
        module = package if name == '__init__.py' else '%s.%s' % (package, name[:-3])
        found[module] = os.path.join(directory, name)
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
      # `from modern import train` imports the module modern.train.
      names.extend('%s.%s' % (node.module, alias.name) for alias in node.names)
  return names


def _project_graph():
  """Dict module -> sorted project modules it imports (packages' __init__ left out)."""
  modules = _modules()
  graph = {}
  for module, path in modules.items():
    graph[module] = sorted({name for name in _imports(path)
                            if name in modules and name not in PACKAGES
                            and name != module})
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


def test_no_module_imports_private_tensorflow():
  private = {module: [name for name in _imports(path)
                      if name.startswith(('tensorflow.python',
                                          'tensorflow.compiler'))]
             for module, path in _modules().items()}
  assert {module: names for module, names in private.items() if names} == {}


def test_no_import_cycles():
  assert _cycle(_project_graph()) is None


def test_layers_point_one_way():
  """cli -> crosscheck/convert/bench -> legacy, modern -> common."""
  graph = _project_graph()
  for module, targets in graph.items():
    if module.startswith('common'):
      assert not [t for t in targets if not t.startswith('common')], module
    if module.startswith('legacy'):
      assert not [t for t in targets if t.startswith('modern')], module
    if module.startswith('modern'):
      assert not [t for t in targets if t.startswith('legacy')], module
    if module != 'cli':
      assert 'cli' not in targets, module
