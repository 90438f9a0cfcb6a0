"""Every CUDA spelling in a package's source, each with the reason it is safe off CUDA, or none. An audit,
not part of the runtime: only the tests use it.

``tests/test_cuda_inventory.py`` runs this over the installed megatron-core and megatron.training (the
megatron-core wheel's from 0.17, a Megatron-LM checkout's on 0.16) and fails naming file:line for each site
without a verdict, so a new megatron release shows exactly what it added. It reads source text only
(``ast``), imports nothing of megatron, and takes a few seconds.

A site is one spelling: ``torch.cuda.X``, ``from torch.cuda import X``, a ``"cuda"`` / ``"cuda:N"`` /
``"nccl"`` string, a ``'torch.cuda.*Tensor'`` type name, ``.cuda()``, ``.is_cuda``, and pinned host memory
(``.pin_memory()``, a torch function's ``pin_memory=`` other than ``False``), which torch refuses without an
accelerator. Its verdict comes from the rules by which ``adapter.cuda_routing`` routes every module of
megatron, checked against what the device layer and the views really answer, then from the reasoned
tables in ``tests.cuda_sites_table``:

- ``routed: device layer``: ``torch.cuda.X`` (any import form) where ``adapter.device`` defines ``X``;
- ``routed: strings view``: a device string given to a call the strings view routes (tensor factories'
  ``device=``, ``torch.device``, ``autocast``/``amp`` device types, ``backend=`` of group constructors);
- ``routed: tensor calls``: a tensor-method spelling, or a ``device=`` string, inside a function the rule
  wraps (``cuda_routing.spells_tensor_calls`` of the same function, decided here from the source: among
  others, a function that gives a CUDA ``device=`` to a call the strings view does not route); pinned
  memory inside a function the rule wraps where there is no accelerator (it is real where there is one);
- ``refused: <flag>``: code of a feature refused off CUDA when configured (``patches/cuda_only_features.py``);
- ``patched: <target>``: code a registry patch replaces;
- ``as written: <reason>``: right off CUDA as it stands (a device-type test that answers False, a default
  the caller overrides, ...).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import torch

from adapter import cuda_only_features, device, torch_view
from tests import cuda_sites_table as table

_CUDA_TYPE_NAME = re.compile(r"torch\.cuda\.[A-Za-z0-9]*Tensor$")
_GROUP_CONSTRUCTORS = frozenset(torch_view._GROUP_CONSTRUCTORS)
_DEVICE_TAKERS = frozenset(torch_view._FACTORIES) | {"device"}
_DEVICE_TYPE_TAKERS = frozenset({"autocast", "custom_fwd", "custom_bwd"})


@dataclasses.dataclass(frozen=True)
class Site:
    path: str  # relative to the scanned root's parent, e.g. megatron/core/utils.py
    line: int
    spelling: str
    function: str  # qualified name of the enclosing function, or "<module>"
    verdict: str  # "" when nothing accounts for it
    key: str = ""  # the table entry, or feature's code entry, that gave the verdict, if one did

    def __str__(self):
        return f"{self.path}:{self.line}: {self.spelling} in {self.function}: {self.verdict or 'UNACCOUNTED'}"


def _is_device_string(value) -> bool:
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:") or value == "nccl")


def _dotted(node) -> str:
    """``a.b.c`` for an attribute chain on a name, else ''."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _answered(path: list[str]) -> bool:
    """Whether the device layer answers ``torch.cuda.<path>`` with something of its own (a torch.cuda
    class passed through for isinstance checks does not count: constructing it off CUDA would fail)."""
    ours, theirs = device, torch.cuda
    for name in path:
        try:
            ours = getattr(ours, name)
        except AttributeError:
            return False
        theirs = getattr(theirs, name, None)
    return ours is not theirs


class _Scanner(ast.NodeVisitor):
    """Collects the sites of one module, with the enclosing function and the node's parents."""

    def __init__(self, path: str, own: frozenset = frozenset()):
        self.path = path
        self.own = own  # the names of the functions and classes the module defines at its top level
        self.stack: list[str] = []
        self.functions: list[ast.AST] = []
        self.parents: list[ast.AST] = []
        self.sites: list[tuple] = []  # (line, spelling, function qualname, function node, context)

    def _add(self, node, spelling: str, context: str) -> None:
        qualname = ".".join(self.stack) or "<module>"
        function = self.functions[-1] if self.functions else None
        self.sites.append((node.lineno, spelling, qualname, function, context))

    def generic_visit(self, node):
        self.parents.append(node)
        super().generic_visit(node)
        self.parents.pop()

    def _scoped(self, node, is_function: bool):
        self.stack.append(node.name)
        if is_function:
            self.functions.append(node)
        self.generic_visit(node)
        if is_function:
            self.functions.pop()
        self.stack.pop()

    def visit_FunctionDef(self, node):
        self._scoped(node, True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self._scoped(node, False)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.startswith("torch.cuda"):
                self._add(node, f"import {alias.name}", "import")

    def visit_ImportFrom(self, node):
        if node.level == 0 and node.module and node.module.startswith("torch.cuda"):
            for alias in node.names:
                self._add(node, f"from {node.module} import {alias.name}", "import")
        elif node.level == 0 and node.module == "torch" and any(a.name == "cuda" for a in node.names):
            self._add(node, "from torch import cuda", "import")

    def visit_Attribute(self, node):
        dotted = _dotted(node)
        parent = self.parents[-1] if self.parents else None
        if dotted.startswith("torch.cuda") and not (
                isinstance(parent, ast.Attribute) and _dotted(parent).startswith("torch.cuda")):
            self._add(node, dotted, "torch.cuda")
        elif node.attr == "is_cuda":
            self._add(node, ".is_cuda", "tensor")
        elif node.attr == "cuda" and dotted != "torch.cuda" and isinstance(parent, ast.Call) and parent.func is node:
            self._add(node, ".cuda()", "tensor")
        elif node.attr == "pin_memory" and isinstance(parent, ast.Call) and parent.func is node:
            self._add(node, ".pin_memory()", "pin")
        self.generic_visit(node)

    def visit_keyword(self, node):
        """``pin_memory=`` given to a torch function (a tensor factory); other callers' keywords of that
        name (``DataLoader``, megatron's own classes) are theirs to honour."""
        call = self.parents[-1] if self.parents else None
        if node.arg == "pin_memory" and not (isinstance(node.value, ast.Constant) and node.value.value is False) \
                and isinstance(call, ast.Call) and _dotted(call.func).startswith("torch."):
            self._add(node.value, "pin_memory=", "pin")
        self.generic_visit(node)

    def visit_Constant(self, node):
        if _is_device_string(node.value):
            self._add(node, repr(node.value), self._string_context(node))
        elif isinstance(node.value, str) and _CUDA_TYPE_NAME.match(node.value):
            self._add(node, repr(node.value), "tensor")

    def _string_context(self, node) -> str:
        """How a device string is used: 'device', 'device_type', 'backend' (given to a call the strings
        view routes), 'device-layer' (``device=`` of a torch.cuda call), 'to' (``.to("cuda")``), 'device-kw'
        (``device=`` of another torch callable, ``.to`` or the module's own function or class: the torch calls
        it makes are answered where the spelling function is wrapped), 'device-handed' (``device=`` of any
        other call: the string travels on into code no mode answers), 'compare' (an operand of ``==`` /
        ``in``), or 'other'."""
        up = len(self.parents) - 1
        parent = self.parents[up] if self.parents else None
        if isinstance(parent, ast.JoinedStr):  # f"cuda:{rank}": the f-string is what is passed
            node, up = parent, up - 1
            parent = self.parents[up]
        keyword = None
        if isinstance(parent, ast.keyword):
            keyword, parent = parent.arg, self.parents[up - 1]
        if isinstance(parent, ast.Compare):
            return "compare"
        if not isinstance(parent, ast.Call):
            return "other"
        func = parent.func
        if getattr(func, "id", "") == "partial" and parent.args:  # partial(torch.amp.custom_fwd, device_type=...)
            func = parent.args[0]
        callee = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        on_torch = _dotted(func).startswith("torch.")
        positional = keyword is None and bool(parent.args) and parent.args[0] is node
        if keyword == "device" and _dotted(func).startswith("torch.cuda."):
            return "device-layer"
        if on_torch and callee in _DEVICE_TAKERS and (keyword == "device" or (callee == "device" and positional)):
            return "device"
        if callee in _DEVICE_TYPE_TAKERS and on_torch and (keyword == "device_type" or positional):
            return "device_type"
        if callee in _GROUP_CONSTRUCTORS and keyword == "backend" and node.value == "nccl":
            return "backend"
        if callee == "to" and (keyword == "device" or positional):
            return "to"
        if keyword == "device":
            return "device-kw" if on_torch or callee == "to" or _dotted(func) in self.own else "device-handed"
        return "other"


def _pins(node: ast.AST) -> bool:
    """The source form of the rule's pinned-memory fact: ``pin_memory`` as an attribute, a keyword's name or
    a string (what puts it in a code object's names or constants), or ``record_stream`` as an attribute."""
    return (isinstance(node, ast.Attribute) and node.attr in ("pin_memory", "record_stream")) or (
        isinstance(node, ast.keyword) and node.arg == "pin_memory") or (
        isinstance(node, ast.Constant) and node.value == "pin_memory")


def _tensor_calls_in(function: ast.AST | None, pins: bool = False) -> bool:
    """The source form of ``cuda_routing.spells_tensor_calls``: whether the rule wraps this function (its
    outermost enclosing function, which is what a module defines); ``pins``: without an accelerator."""
    if function is None:
        return False
    for node in ast.walk(function):
        if pins and _pins(node):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _CUDA_TYPE_NAME.match(node.value):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, on = node.func.attr, _dotted(node.func.value)
            if attr == "cuda" and on != "torch":
                return True
            if attr == "to" and node.args and isinstance(node.args[0], ast.Constant) and (
                    _is_device_string(node.args[0].value) and node.args[0].value != "nccl"):
                return True
        if isinstance(node, ast.Call) and _device_string_handed_on(node):
            return True
    return False


def _device_string_handed_on(call: ast.Call) -> bool:
    """``device=`` with a CUDA device string (or an f-string starting with one) given to a call that the
    strings view does not route: a torch.nn constructor, ``.to(device=...)``, a helper of one's own."""
    dotted = _dotted(call.func)
    if dotted.startswith("torch.") and (dotted.startswith("torch.cuda.") or call.func.attr in _DEVICE_TAKERS):
        return False
    for keyword in call.keywords:
        value = keyword.value
        if keyword.arg == "device" and isinstance(value, ast.JoinedStr) and value.values:
            value = value.values[0]
        if keyword.arg == "device" and isinstance(value, ast.Constant) and (
                _is_device_string(value.value) and value.value != "nccl"):
            return True
    return False


def _replaced_by_patch(module: str, qualname: str, replaced: frozenset) -> str:
    """The registry target that replaces the function holding this site (or a function enclosing it)."""
    parts = qualname.split(".")
    for i in range(len(parts), 0, -1):
        target = f"{module}:{'.'.join(parts[:i])}"
        if target in replaced:
            return target
    return ""


def _routed(spelling: str, wrapped: bool, context: str) -> bool:
    """Whether the routing rules of adapter.cuda_routing answer this site."""
    if context == "import":
        names = spelling.split()[1].split(".")[2:] + ([] if spelling.startswith("import") else
                                                     [spelling.rpartition(" import ")[2]])
        return names in ([], ["cuda"]) or _answered(names)
    if context == "torch.cuda":
        return _answered(spelling.split(".")[2:])
    if context in ("device", "device_type", "backend", "device-layer"):
        return True
    return context in ("tensor", "to", "device-kw", "pin") and wrapped


_RULES = {"import": "device layer", "torch.cuda": "device layer", "device-layer": "device layer",
          "device": "strings view", "device_type": "strings view", "backend": "strings view"}


def _verdict(module: str, spelling: str, qualname: str, wrapped: bool, context: str,
             replaced: frozenset) -> tuple[str, str]:
    """(verdict, the table key or feature behind it)."""
    owned = cuda_only_features.owning_code(module, qualname, spelling)
    if owned is not None:
        feature, code = owned
        return f"refused: {feature.name} ({', '.join(feature.settings) or 'constructing it'})", code
    target = _replaced_by_patch(module, qualname, replaced)
    if target:
        return f"patched: {target}", target
    key, target = table.patched(module, qualname, spelling)
    if key:
        return f"patched: {target}", key
    if _routed(spelling, wrapped, context):
        return f"routed: {_RULES.get(context, 'tensor calls')}", ""
    key, reason = table.as_written(module, qualname, spelling)
    return (f"as written: {reason}", key) if key else ("", "")


def _outermost_functions(tree: ast.AST) -> dict:
    """id(function node) -> the function a module or class body defines that contains it: the unit the
    rule wraps (a nested function runs inside its wrapped definer)."""
    owners = {}

    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            inner = owner if owner is not None else (child if is_function else None)
            if is_function:
                owners[id(child)] = inner
            visit(child, inner)

    visit(tree, None)
    return owners


def _generator(function: ast.AST) -> bool:
    """The rule does not wrap generators (a mode entered there would stay on while suspended)."""
    pending = list(ast.iter_child_nodes(function))
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            pending.extend(ast.iter_child_nodes(node))
    return False


def scan_module(source: str, path: str, module: str, replaced: frozenset = frozenset()) -> list[Site]:
    """The sites of one module's source; ``replaced``: the registry targets that replace a function."""
    tree = ast.parse(source, path)
    scanner = _Scanner(path, frozenset(node.name for node in tree.body if isinstance(
        node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))))
    scanner.visit(tree)
    owners = _outermost_functions(tree)
    wraps = {}  # (id(function), pins) -> whether the rule wraps it
    sites = []
    for line, spelling, qualname, function, context in scanner.sites:
        outer = owners.get(id(function)) if function is not None else None
        key = (id(outer), context == "pin")  # a pin site is about the backend without an accelerator
        if outer is not None and key not in wraps:
            wraps[key] = _tensor_calls_in(outer, pins=key[1]) and not _generator(outer)
        wrapped = outer is not None and wraps[key]
        sites.append(Site(path, line, spelling, qualname,
                          *_verdict(module, spelling, qualname, wrapped, context, replaced)))
    return sites


def _defined_functions(tree: ast.AST, prefix: str = ""):
    """(qualname, node) of each function a module or class body defines, classes nested in classes too:
    the units ``cuda_routing`` considers for wrapping."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from _defined_functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, (ast.If, ast.Try)):  # conditional definitions are still the module's
            yield from _defined_functions(node, prefix)


def wrapped_functions(package_dir: Path, pins: bool = False) -> set[str]:
    """``module:Qualname`` of every function the rule wraps to answer tensor-method spellings, decided from
    the source (``pins``: on a backend without an accelerator); tests compare it with what routing really
    wraps."""
    package_dir = Path(package_dir)
    root = package_dir.parent.parent if package_dir.parent.name == "megatron" else package_dir.parent
    found = set()
    for file in sorted(package_dir.rglob("*.py")):
        module = ".".join(file.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
        found.update(f"{module}:{qualname}" for qualname, node in _defined_functions(tree)
                     if _tensor_calls_in(node, pins) and not _generator(node))
    return found


def replaced_targets(registry) -> frozenset:
    """The targets ``registry`` replaces outright on this backend: their original code never runs."""
    return frozenset(p.target for p in registry.patches() if p.kind == "replace")


def scan(package_dir: Path, replaced: frozenset = frozenset()) -> list[Site]:
    """Every site in the package at ``package_dir`` (e.g. .../site-packages/megatron/core)."""
    package_dir = Path(package_dir)
    root = package_dir.parent.parent if package_dir.parent.name == "megatron" else package_dir.parent
    sites = []
    for file in sorted(package_dir.rglob("*.py")):
        relative = file.relative_to(root)
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        sites.extend(scan_module(file.read_text(encoding="utf-8"), relative.as_posix(), module, replaced))
    return sites
