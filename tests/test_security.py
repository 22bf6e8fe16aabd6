"""No code path that runs what a file or a download says: an AST scan of the project's Python sources for pickle
loads (torch.load, pickle and its relatives, numpy.load with allow_pickle, d3rlpy model files), remote code
(trust_remote_code), eval/exec/compile and unsafe yaml.load.

Scanned: kvcompile/, runtime/, benchmarks/ and tests/ (a test that unpickles a file is as dangerous on a developer's
machine as the package doing it), except this file, whose control snippets hold every forbidden pattern. The AST,
not the text, is scanned, so that comments and docstrings that name a pattern are not findings; aliases
(`import numpy as np`, `from torch import load`), `getattr(module, "name")` and `__import__("name")` are resolved.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED_FOLDERS = ("kvcompile", "runtime", "benchmarks", "tests")

PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}
UNPICKLING_CALLS = {"torch.load", "torch.serialization.load", "pandas.read_pickle"}
CODE_BUILTINS = {"eval", "exec", "compile"}
UNSAFE_YAML = {"yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all"}
SAFE_YAML_LOADERS = {"yaml.SafeLoader", "yaml.CSafeLoader", "yaml.BaseLoader"}
# d3rlpy saves and loads models by pickling them; fitting in memory and predicting are fine.
D3RLPY_PERSISTENCE = {"save", "load", "save_model", "load_model", "load_learnable", "from_json", "save_policy"}
REMOTE_CODE = "trust_remote_code"
IMPORT_FUNCTIONS = ("__import__", "importlib.import_module")


class Scanner(ast.NodeVisitor):
    def __init__(self, tree: ast.Module) -> None:
        self.findings: list[tuple[int, str]] = []
        self.aliases: dict[str, str] = {}
        self.defined: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):  # `import a.b` binds a; `import a.b as c` binds c to a.b
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    self.aliases[alias.asname or top] = alias.name if alias.asname else top
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    self.aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(node.name)
        self.uses_d3rlpy = any(name.split(".")[0] == "d3rlpy" for name in self.aliases.values())

    def flag(self, node: ast.AST, message: str) -> None:
        self.findings.append((node.lineno, message))

    def dotted(self, node: ast.AST) -> str | None:
        """The qualified name an expression refers to, through imports, getattr and __import__ (None if unknown)."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.dotted(node.value)
            return f"{base}.{node.attr}" if base else None
        if isinstance(node, ast.Call):
            function = self.dotted(node.func)
            if function == "getattr" and _constant_text(node.args[1:2]) is not None:
                base = self.dotted(node.args[0])
                return f"{base}.{_constant_text(node.args[1:2])}" if base else None
            if function in IMPORT_FUNCTIONS:
                return _constant_text(node.args[:1])
        return None

    # -- visitors --------------------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.check_module(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.check_module(node, node.module or "")

    def check_module(self, node: ast.AST, name: str) -> None:
        if name.split(".")[0] in PICKLE_MODULES:
            self.flag(node, f"imports {name} (pickle-based serialisation)")

    def visit_Call(self, node: ast.Call) -> None:
        name = (self.dotted(node.func) or "").removeprefix("builtins.")
        allow_pickle, loader = _argument(node, "allow_pickle", 2), _argument(node, "Loader", 1)
        if name.split(".")[0] in PICKLE_MODULES:
            self.flag(node, f"calls {name} (pickle-based serialisation)")
        elif name in UNPICKLING_CALLS:
            self.flag(node, f"calls {name} (unpickles its input)")
        elif name in CODE_BUILTINS and name not in self.defined:
            self.flag(node, f"calls the builtin {name}() (runs code made from data)")
        elif name == "numpy.load" and allow_pickle is not None and not _is_false(allow_pickle):
            self.flag(node, "calls numpy.load with allow_pickle")
        elif name in ("yaml.load", "yaml.load_all") and (
            loader is None or self.dotted(loader) not in SAFE_YAML_LOADERS
        ):
            self.flag(node, f"calls {name} without a SafeLoader")
        elif name in UNSAFE_YAML:
            self.flag(node, f"calls {name} (not the safe loader)")
        elif name in IMPORT_FUNCTIONS and _constant_text(node.args[:1]) is not None:
            self.check_module(node, _constant_text(node.args[:1]))
        elif (
            isinstance(node.func, ast.Attribute)
            and node.func.attr in D3RLPY_PERSISTENCE
            and (self.uses_d3rlpy or name.startswith("d3rlpy."))
        ):
            self.flag(node, f"calls .{node.func.attr}() in a module that uses d3rlpy (d3rlpy model files are pickles)")
        for keyword in node.keywords:
            # Only the literal False, which every model load passes (issue #73): anything else may let code run.
            refused = isinstance(keyword.value, ast.Constant) and keyword.value.value is False
            if keyword.arg == REMOTE_CODE and not refused:
                self.flag(keyword.value, f"passes {REMOTE_CODE}")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if node.value == REMOTE_CODE:
            self.flag(node, f"names {REMOTE_CODE} in a string (a kwargs key or getattr name)")

    def visit_Name(self, node: ast.Name) -> None:
        if node.id == REMOTE_CODE:
            self.flag(node, f"uses a name {REMOTE_CODE}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == REMOTE_CODE:
            self.flag(node, f"sets or reads an attribute {REMOTE_CODE}")
        self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> None:
        if node.arg == REMOTE_CODE:
            self.flag(node, f"takes a parameter {REMOTE_CODE}")


def _constant_text(nodes: list[ast.expr]) -> str | None:
    if nodes and isinstance(nodes[0], ast.Constant) and isinstance(nodes[0].value, str):
        return nodes[0].value
    return None


def _argument(call: ast.Call, keyword: str, position: int) -> ast.expr | None:
    for item in call.keywords:
        if item.arg == keyword:
            return item.value
    return call.args[position] if len(call.args) > position else None


def _is_false(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value in (False, None, 0)


def scan(source: str, filename: str = "<snippet>") -> list[str]:
    """Findings in one file's source, as 'file:line: what'."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        return [f"{filename}:{exc.lineno}: cannot be parsed, so it cannot be checked ({exc.msg})"]
    scanner = Scanner(tree)
    scanner.visit(tree)
    return [f"{filename}:{line}: {message}" for line, message in sorted(set(scanner.findings))]


def project_sources() -> list[Path]:
    this = Path(__file__).resolve()
    return sorted(p for folder in SCANNED_FOLDERS for p in (ROOT / folder).rglob("*.py") if p.resolve() != this)


def test_the_project_sources_load_no_pickles_remote_code_or_code_from_data():
    sources = project_sources()
    assert len(sources) > 50 and ROOT / "runtime" / "kvruntime" / "artifacts" / "artifact.py" in sources
    findings = [f for path in sources for f in scan(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))]
    assert findings == [], "\n".join(findings)


@pytest.mark.parametrize(
    "snippet, finding",
    [
        ("import torch\nstate = torch.load(path)", "calls torch.load"),
        ("from torch import load as read\nstate = read(path)", "calls torch.load"),
        ("import torch\nstate = getattr(torch, 'load')(path)", "calls torch.load"),
        ("import importlib\nm = importlib.import_module('torch').load(path)", "calls torch.load"),
        ("import pickle\n", "imports pickle"),
        ("from dill import loads\n", "imports dill"),
        ("import joblib as jl\n", "imports joblib"),
        ("import _pickle\n", "imports _pickle"),
        ("import marshal\n", "imports marshal"),
        ("import shelve\n", "imports shelve"),
        ("data = __import__('pickle').loads(blob)", "calls pickle.loads"),
        ("import numpy as np\nx = np.load(path, allow_pickle=True)", "numpy.load with allow_pickle"),
        ("from numpy import load\nx = load(path, None, True)", "numpy.load with allow_pickle"),
        ("import pandas as pd\nframe = pd.read_pickle(path)", "calls pandas.read_pickle"),
        ("import d3rlpy\nalgo = d3rlpy.load_learnable(path)", "calls .load_learnable()"),
        ("import d3rlpy\nalgo.save_model(path)", "calls .save_model()"),
        ("import d3rlpy\nalgo.save(path)", "calls .save()"),
        ("import d3rlpy\nconfig = d3rlpy.algos.DiscreteCQLConfig.from_json(path)", "calls .from_json()"),
        (
            "def load():\n    import d3rlpy\n    return d3rlpy\nalgo = load()\nalgo.load_model(path)",
            "calls .load_model()",
        ),
        ("model = AutoModel.from_pretrained(name, trust_remote_code=True)", "passes trust_remote_code"),
        ("model = AutoModel.from_pretrained(name, trust_remote_code=allowed)", "passes trust_remote_code"),
        (
            "model = AutoModel.from_pretrained(name, **{'trust_remote_code': True})",
            "names trust_remote_code in a string",
        ),
        ("config.trust_remote_code = True", "sets or reads an attribute trust_remote_code"),
        ("value = eval(text)", "calls the builtin eval()"),
        ("exec(code)", "calls the builtin exec()"),
        ("import builtins\nbuiltins.exec(code)", "calls the builtin exec()"),
        ("program = compile(text, 'f', 'exec')", "calls the builtin compile()"),
        ("import yaml\ndata = yaml.load(text)", "calls yaml.load without a SafeLoader"),
        ("import yaml\ndata = yaml.load(text, Loader=yaml.Loader)", "calls yaml.load without a SafeLoader"),
        ("import yaml\ndata = yaml.unsafe_load(text)", "calls yaml.unsafe_load"),
        ("def broken(:\n", "cannot be parsed"),
    ],
)
def test_the_scanner_flags_each_forbidden_pattern(snippet, finding):
    findings = scan(snippet)
    assert any(finding in f for f in findings), findings
    assert all(f.startswith("<snippet>:") for f in findings)


def test_the_scanner_leaves_harmless_look_alikes_alone():
    snippet = '''
"""A docstring may say torch.load, pickle, eval( and trust_remote_code."""
import re
import numpy as np
import torch
import yaml
# torch.load(path) in a comment is no call
pattern = re.compile("x")
model.eval()
fast = torch.compile(model)
array = np.load(path)
array = np.load(path, allow_pickle=False)
data = yaml.load(text, Loader=yaml.SafeLoader)
data = yaml.safe_load(text)
message = "pass trust_remote_code=True at your own risk"
model = AutoModel.from_pretrained(name, trust_remote_code=False)
torch.save(state, path)
def compile(source):
    return source
compile("x")
'''
    assert scan(snippet) == []


@pytest.mark.parametrize(
    "base",
    ["org/na:me", "org/a\nb: c", "---", "org/x # y", "org/q\"uo'te", "org/[1, 2]", "org/{a: b}", "&anchor *alias",
     "org/a\n---\nlibrary_name: evil"],
)  # fmt: skip
def test_the_cards_yaml_front_matter_round_trips_a_base_model_with_yaml_specials_and_adds_no_key(base):
    """The front matter is written by a YAML emitter: a value with `:`, a newline, `---`, `#` or quotes parses back
    to itself, under its key, beside the card's own keys and no other."""
    import yaml

    from kvcompile.bundle import CARD_TAGS, model_card

    model = dict(
        architecture="LlamaForCausalLM", num_layers=4, num_query_heads=4, num_kv_heads=2, weights_hash="0" * 16
    )
    card = model_card({"base_model": base, "model": model, "artifacts": []}, [])
    assert card.startswith("---\n")
    front = card.removeprefix("---\n").split("\n---\n", 1)[0]
    assert yaml.safe_load(front) == {"base_model": base, "library_name": "kvcompile", "tags": list(CARD_TAGS)}
