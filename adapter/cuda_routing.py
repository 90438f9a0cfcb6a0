"""CUDA routing, the mechanism: CUDA spellings routed to this backend's device, for whole packages, by rule.

megatron spells CUDA in about 600 places across a hundred modules: ``torch.cuda.*`` calls, import-time
checks such as ``(torch.FloatTensor, torch.cuda.FloatTensor)``, ``device="cuda"``, ``.cuda()``,
``.is_cuda``, ``backend="nccl"``. A list of modules to patch is out of date with the next release; so a
package is routed as a whole (``route("megatron")``, from the registry's one ``route`` patch; a user's
own packages through ``adapter.route_cuda``), and every module under it, now or in a later release, gets:

1. its ``torch``: a meta-path finder hands each module of a routed package, before its code runs, builtins
   whose ``__import__`` answers ``import torch`` with a view (``adapter.torch_view``) whose ``torch.cuda``
   is ``adapter.device``, and ``from torch.cuda import x`` with the device layer's ``x``. So import-time
   checks are routed too. Modules whose code holds a CUDA device string get the view that also maps
   those (``routed_strings``); modules that hold ``"nccl"`` or pass a ``backend=`` on to a
   torch.distributed group constructor (a backend name their caller gave them) get a torch.distributed
   that maps ``"nccl"``; all others keep the real torch.distributed. The code that runs is the module's
   own, unchanged;
2. its tensor methods: each function and method defined in the module whose code spells CUDA in a tensor
   method (``.cuda()``, ``.is_cuda``, a ``'torch.cuda.*Tensor'`` type name, ``.to("cuda")``), or gives
   ``device="cuda"`` to a call the view does not route (``torch.nn.Linear(..., device="cuda")``, a helper),
   is wrapped to run under ``adapter.torch_view.CudaCalls``, which answers those spellings for that
   module's own calls only. Per-layer code spells none of them in megatron-core 0.16.1-0.19.2
   (tests/test_cuda_inventory.py). On a backend without an accelerator (cpu), functions that pin host
   memory (``.pin_memory()``, ``pin_memory=True``) or tie a tensor to a stream (``t.record_stream(s)``)
   are wrapped too: there is nothing to pin for and the CPU's one stream needs no tie, while torch
   refuses to pin and has no CPU kernel for ``record_stream``.

Nothing global changes: ``torch.cuda`` is the same object for every other module and library. Modules a
routed package imported before routing began get the same, after the fact (``route`` rebinds their
names), except for values their import computed. ``unroute`` puts everything back.

The registry entry that installs this for megatron is ``patches/cuda_routing.py``; ``adapter.torch_view``
is the view of torch that routed modules get.
"""

from __future__ import annotations

import builtins
import dataclasses
import dis
import functools
import importlib.abc
import inspect
import re
import sys
import threading
import types

import torch

from adapter import backend, device, torch_view

_CUDA_TYPE_NAME = re.compile(r"torch\.cuda\.[A-Za-z0-9]*Tensor$")
_ATTRIBUTE_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_OPTIMIZED = inspect.CO_OPTIMIZED  # set on function code, not on class bodies or modules


# ---------------------------------------------------------------------------------------- the rule
def _is_device_string(value) -> bool:
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:") or value == "nccl")


def _strings(code: types.CodeType) -> set:
    """The string constants of ``code``, those the compiler folded into tuples and frozensets included
    (``x in ["cuda", "cpu"]`` compiles to a tuple constant)."""
    found = {c for c in code.co_consts if type(c) is str}
    for constant in code.co_consts:
        if type(constant) in (tuple, frozenset):
            found.update(c for c in constant if type(c) is str)
    return found


_GROUP_CONSTRUCTOR_NAMES = frozenset(torch_view._GROUP_CONSTRUCTORS)
# What a code object (with the code nested in it) spells, as bits: each rule below asks for some of them.
_DEVICE_STRINGS, _NCCL, _HANDS_ON_BACKEND, _TENSOR_CALLS, _PINS = 1, 2, 4, 8, 16


def _own_facts(code: types.CodeType) -> int:
    strings, names = _strings(code), code.co_names
    facts = _DEVICE_STRINGS if any(map(_is_device_string, strings)) else 0
    if "nccl" in strings:
        facts |= _NCCL
    if "backend" in strings and not _GROUP_CONSTRUCTOR_NAMES.isdisjoint(names):
        facts |= _HANDS_ON_BACKEND
    if ("is_cuda" in names or any(map(_CUDA_TYPE_NAME.match, strings))
            or (("cuda" in names or "to" in names) and _tensor_method_here(code))
            or (facts & _DEVICE_STRINGS and "device" in strings and _device_string_handed_on(code))):
        facts |= _TENSOR_CALLS
    if "pin_memory" in names or "pin_memory" in strings or "record_stream" in names:
        facts |= _PINS  # t.pin_memory(), pin_memory= (a keyword's name), t.record_stream(s)
    return facts


_FACTS: dict[int, tuple] = {}  # id(code) -> (code, facts): code objects stay alive while cached


def _facts(code: types.CodeType) -> int:
    """The facts of ``code`` and of all code nested in it, found in one walk and cached by identity.
    (``functools.lru_cache`` would hash each code object, and a code object's hash covers its nested
    code: asking for every function of a module would hash the module's code over and over.)"""
    hit = _FACTS.get(id(code))
    if hit is not None and hit[0] is code:
        return hit[1]
    facts = _own_facts(code)
    for constant in code.co_consts:
        if type(constant) is types.CodeType:
            facts |= _facts(constant)
    _FACTS[id(code)] = (code, facts)
    return facts


def spells_device_strings(code: types.CodeType) -> bool:
    """Whether ``code``, or code nested in it, holds ``"cuda"``, ``"cuda:N"`` or ``"nccl"``: its module
    gets the view that maps device and backend strings."""
    return bool(_facts(code) & _DEVICE_STRINGS)


def names_backend(code: types.CodeType) -> bool:
    """Whether ``code``, or code nested in it, holds ``"nccl"`` or hands a backend on: its module's
    torch.distributed maps ``"nccl"``; other modules keep the real one (``mock.patch`` reaches it)."""
    return bool(_facts(code) & (_NCCL | _HANDS_ON_BACKEND))


def spells_tensor_calls(code: types.CodeType, pins: bool = False) -> bool:
    """Whether ``code``, or code nested in it, spells CUDA in a tensor method: ``.cuda()``, ``.is_cuda``, a
    ``'torch.cuda.*Tensor'`` type name (compared with ``t.type()``), ``.to("cuda")``; with ``pins``, also
    pinned host memory (``t.pin_memory()``, ``pin_memory=``), which needs an accelerator to pin for, and
    ``t.record_stream(s)``, which needs one to have streams."""
    return bool(_facts(code) & (_TENSOR_CALLS | (_PINS if pins else 0)))


def view_kind(code: types.CodeType) -> str:
    """Which view a module with this code gets: "strings" (device strings mapped) and/or "dist" (backend
    names mapped), joined by "+", or "" (torch.cuda routed only)."""
    return "+".join(k for k, hit in (("strings", spells_device_strings(code)), ("dist", names_backend(code))) if hit)


# The rule reads a few instructions around each load of the attribute ``cuda`` or ``to``. It runs at import
# for every megatron function that names either, so on the CPython versions whose encoding is known here
# (3.11, 3.12) it finds those loads in co_code with bytes.find and decodes only their neighbours; dis's
# Instruction objects for whole functions cost ~0.3 s per megatron import. Other versions use dis.
_OP = dis.opmap
_CACHE = _OP.get("CACHE", 0)
_FAST_DECODE = sys.version_info[:2] in ((3, 11), (3, 12))
_ATTR_SHIFT = 0 if sys.version_info[:2] == (3, 11) else 1  # 3.12: LOAD_ATTR's arg is namei << 1 | method
# 3.12 keeps LOAD_METHOD in opmap as a pseudo-instruction (opcode >= 256) that the compiler never emits
_ATTRIBUTE_OPS = tuple(_OP[n] for n in ("LOAD_ATTR", "LOAD_METHOD") if _OP.get(n, 256) < 256)


def _arg(raw: bytes, offset: int) -> int:
    arg, shift, p = raw[offset + 1], 8, offset - 2
    while p >= 0 and raw[p] == dis.EXTENDED_ARG:
        arg |= raw[p + 1] << shift
        shift, p = shift + 8, p - 2
    return arg


def _decode(code: types.CodeType, offset: int) -> tuple[str, object]:
    """(opname, argval) of the instruction at ``offset``; argval only for the loads the rule reads."""
    op, arg, name = code.co_code[offset], _arg(code.co_code, offset), dis.opname[code.co_code[offset]]
    if name in ("LOAD_METHOD", "LOAD_NAME") or (name == "LOAD_ATTR" and not _ATTR_SHIFT):
        return name, code.co_names[arg]
    if name in ("LOAD_GLOBAL", "LOAD_ATTR"):
        return name, code.co_names[arg >> 1]
    if name in ("LOAD_FAST", "LOAD_FAST_CHECK"):
        return "LOAD_FAST", code.co_varnames[arg] if arg < len(code.co_varnames) else None
    if op == _OP["LOAD_CONST"]:
        return name, code.co_consts[arg]
    return name, None


def _step(raw: bytes, offset: int, direction: int) -> int:
    """The offset of the next real instruction from ``offset`` (caches and EXTENDED_ARG prefixes skipped)."""
    offset += direction
    while 0 <= offset < len(raw) and (raw[offset] == _CACHE or raw[offset] == dis.EXTENDED_ARG):
        offset += direction
    return offset


def _load_offsets(code: types.CodeType, attribute: str):
    """Offsets of the instructions loading ``attribute`` (a name in co_names), found as byte patterns."""
    raw, index = code.co_code, code.co_names.index(attribute)
    patterns = []
    for op in _ATTRIBUTE_OPS:
        args = (index << 1, index << 1 | 1) if _ATTR_SHIFT and dis.opname[op] == "LOAD_ATTR" else (index,)
        patterns += [bytes((op, a)) for a in args if a < 256]
        if any(a >= 256 for a in args):  # an EXTENDED_ARG prefix: look at every instruction
            yield from (o for o in range(0, len(raw), 2) if raw[o] == op and _decode(code, o)[1] == attribute)
    for pattern in patterns:
        offset = raw.find(pattern)
        while offset != -1:
            if offset % 2 == 0 and _decode(code, offset)[1] == attribute:
                yield offset
            offset = raw.find(pattern, offset + 1)


def _attribute_loads(code: types.CodeType, attribute: str):
    """(instruction before, instruction after) each load of ``attribute`` in ``code``'s own instructions."""
    if not _FAST_DECODE:
        instructions = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname != "EXTENDED_ARG"]
        for i, (opname, argval) in enumerate(instructions):
            if opname in _ATTRIBUTE_LOADS and argval == attribute:
                yield (instructions[i - 1] if i else None,
                       instructions[i + 1] if i + 1 < len(instructions) else None)
        return
    raw = code.co_code
    for offset in _load_offsets(code, attribute):
        before, after = _step(raw, offset, -2), _step(raw, offset, 2)
        yield (_decode(code, before) if before >= 0 else None,
               _decode(code, after) if after < len(raw) else None)


def _names_torch(instruction) -> bool:
    return instruction is not None and instruction[0].startswith("LOAD_") and instruction[1] == "torch"


def _names_cuda_version(instruction) -> bool:
    """``version`` before ``.cuda``: ``torch.version.cuda``, the CUDA version string (0.19 tests it in
    ``if torch.version.cuda``), not a method."""
    return instruction is not None and instruction[0] in _ATTRIBUTE_LOADS and instruction[1] == "version"


def _tensor_method_here(code: types.CodeType) -> bool:
    """``.cuda(...)`` on anything but the name torch, or ``.to("cuda...")``, in ``code``'s own instructions."""
    names = code.co_names
    if "cuda" in names and any(not _names_torch(before) and not _names_cuda_version(before)
                               and (after is None or after[0] not in _ATTRIBUTE_LOADS)
                               for before, after in _attribute_loads(code, "cuda")):
        return True
    return "to" in names and any(after is not None and after[0] == "LOAD_CONST" and _is_device_string(after[1])
                                 and after[1] != "nccl" for _, after in _attribute_loads(code, "to"))


# ``device="cuda"`` given to a call the strings view does not route (``torch.nn.Linear(..., device="cuda")``,
# ``.to(device="cuda")``, a helper of the module's own) reaches torch's factories from code nobody routed,
# inside torch.nn or the helper; ``CudaCalls`` answers ``device=`` of every torch call that the spelling
# function's own call makes, however deep. Read with dis: only code holding both a CUDA device string and a
# ``device`` keyword gets this far (a few functions per release), and calls are read off the stack backwards.
_CALLABLE_SLOTS = 2 if sys.version_info >= (3, 11) else 1  # 3.11+: the callable and its NULL (or self)
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_NAME_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF"})
_DEVICE_TAKERS = frozenset(torch_view._FACTORIES) | {"device"}


def _keyword_calls(code: types.CodeType):
    """(keyword names, argument count, the instructions before the names) of each call with keywords in
    ``code``'s own instructions."""
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
    for k, i in enumerate(ins):
        if i.opname == "KW_NAMES":  # 3.11, 3.12: the CALL follows (3.11: after a PRECALL)
            call = next(j for j in ins[k + 1:] if j.opname == "CALL")
            yield code.co_consts[i.arg], call.arg, ins[:k]
        elif i.opname in ("CALL_FUNCTION_KW", "CALL_KW"):  # 3.10, 3.13: the names are the constant before
            yield ins[k - 1].argval, i.arg, ins[:k - 1]


def _stack_items(before: list, count: int):
    """The (start, end) spans of ``before`` that pushed the top ``count`` stack items, bottom first, read
    backwards by net stack effect; None where a jump lies among them (a conditional expression)."""
    spans, depth, end = [], 0, len(before)
    for j in range(len(before) - 1, -1, -1):
        i = before[j]
        depth += dis.stack_effect(i.opcode, i.arg if i.opcode >= dis.HAVE_ARGUMENT else None)
        pushed = min(depth, count) - len(spans)
        if pushed > 0:
            spans, end = spans + [(j, end)] * pushed, j
        if len(spans) == count:
            return spans[::-1]
        if i.opcode in _JUMPS or i.is_jump_target:
            return None
    return None


def _dotted_load(instructions: list) -> str:
    """``a.b.c`` for instructions that load a name and then attributes of it, else ''."""
    loads = [i for i in instructions if i.opname != "PUSH_NULL"]
    if not loads or loads[0].opname not in _NAME_LOADS or any(i.opname not in _ATTRIBUTE_LOADS for i in loads[1:]):
        return ""
    return ".".join(i.argval for i in loads)


def _holds_device_string(instructions: list) -> bool:
    """A CUDA device string, or an f-string that starts with one (``f"cuda:{rank}"``)."""
    first = instructions[0]
    return first.opname == "LOAD_CONST" and _is_device_string(first.argval) and first.argval != "nccl" and (
        len(instructions) == 1 or instructions[-1].opname == "BUILD_STRING")


def _routed_by_the_view(callee: str) -> bool:
    """Whether the strings view (or the device layer) answers ``device=`` given to ``callee`` (dotted)."""
    return callee.startswith("torch.") and (
        callee.startswith("torch.cuda.") or callee.rpartition(".")[2] in _DEVICE_TAKERS)


def _device_string_handed_on(code: types.CodeType) -> bool:
    """``device=`` with a CUDA device string given to a call the strings view does not route, in ``code``'s
    own instructions."""
    for names, argc, before in _keyword_calls(code):
        if "device" not in names:
            continue
        spans = _stack_items(before, argc + _CALLABLE_SLOTS)
        if spans is None:
            continue
        start, end = spans[len(spans) - len(names) + names.index("device")]
        if _holds_device_string(before[start:end]) and not _routed_by_the_view(
                _dotted_load(before[spans[0][0]:spans[_CALLABLE_SLOTS - 1][1]])):
            return True
    return False


# ---------------------------------------------------------------------------------------- scopes
class _Scopes:
    """The routed packages: name -> who asked (the registry's patch, or a user)."""

    def __init__(self):
        self.packages: dict[str, str] = {}
        self.tops: frozenset = frozenset()

    def covers(self, module: str) -> bool:
        top = module.partition(".")[0]
        return top in self.tops and any(module == p or module.startswith(p + ".") for p in self.packages)

    def set(self, package: str, who: str | None) -> None:
        if who is None:
            self.packages.pop(package, None)
        else:
            self.packages[package] = who
        self.tops = frozenset(p.partition(".")[0] for p in self.packages)


_SCOPES = _Scopes()
_LOCK = threading.RLock()


@dataclasses.dataclass
class _Routed:
    """What routing changed in one module, to put back."""

    module: types.ModuleType
    had_builtins: bool
    builtins: object
    names: dict  # global name -> the value it had (or would have had) without routing
    wrapped: list  # (owner, attribute, raw value before wrapping)


_ROUTED: dict[str, _Routed] = {}
_TORCH_CUDA_FROM: dict[str, set] = {}  # module -> names it took ``from torch.cuda import``
_KINDS: dict[str, str] = {}  # module -> the kind of view it got (``view_kind``)
_VIEWS = {"strings+dist": torch_view.routed_strings, "strings": lambda: torch_view.routed_strings(distributed=False),
          "dist": torch_view.routed_backend, "": torch_view.routed}


# ---------------------------------------------------------------------------------------- import
def _view(module: str, code: types.CodeType | None) -> types.ModuleType:
    if module not in _KINDS:
        _KINDS[module] = view_kind(code) if code is not None else ""
    return _VIEWS[_KINDS[module]]()


def _routed_import(name, globals=None, locals=None, fromlist=(), level=0):
    """``__import__`` for routed modules: torch is the view, torch.cuda the device layer (the name of the
    importing module decides; once routing of its package ends, this is plain ``__import__``)."""
    module = builtins.__import__(name, globals, locals, fromlist, level)
    if level or not name.startswith("torch"):
        return module
    importer = (globals or {}).get("__name__", "")
    if not _SCOPES.covers(importer):
        return module
    if module is torch:
        return _view(importer, sys._getframe(1).f_code)
    if module is torch.cuda:
        _TORCH_CUDA_FROM.setdefault(importer, set()).update(fromlist or ())
        return device
    if name == "torch.distributed" and fromlist and "dist" in _KINDS.get(importer, ""):
        return torch_view.routed_distributed()
    return module


@functools.lru_cache(maxsize=None)
def _routed_builtins() -> dict:
    """The builtins of a routed module: Python's, with ``__import__`` routed. An exact dict, so builtin
    lookups cost what they always cost."""
    return {**vars(builtins), "__import__": _routed_import}


class _Loader(importlib.abc.Loader):
    """The module's own loader, running its own code with the routed builtins, then routing its tensor
    methods. Everything else (sources, resources) is the original loader's."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__dict__["__builtins__"] = _routed_builtins()
        self.loader.exec_module(module)
        _record(module, had_builtins=False, original_builtins=builtins.__dict__)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: the spec of a routed package's module, as the other finders give it,
    with its loader wrapped."""

    routes_cuda = True  # adapter.core_source puts its finder after this one

    def find_spec(self, fullname, path=None, target=None):
        if not _SCOPES.covers(fullname):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


_FINDER = _Finder()


# ---------------------------------------------------------------------------------------- routing a module
def _definitions(module: types.ModuleType):
    """(owner, attribute, raw value) for each function and method ``module`` defines, classes nested in its
    classes included; names it imported, and aliases, are not its definitions."""
    yield from _members(module, vars(module), module.__name__, "")


def _members(owner, namespace, module_name: str, qualname_prefix: str):
    for attr, raw in list(namespace.items()):
        try:
            inner = raw.__func__ if type(raw) in (staticmethod, classmethod) else raw
            mine = getattr(inner, "__module__", None) == module_name
            nested = mine and isinstance(raw, type) and raw.__qualname__ == qualname_prefix + raw.__name__
        except Exception:  # noqa: BLE001 - an object that guards its attributes is not routed (see below)
            continue
        if nested:
            yield from _members(raw, vars(raw), module_name, raw.__qualname__ + ".")
        elif mine and not isinstance(raw, type):
            yield owner, attr, raw


def _function(raw):
    """The plain function behind a function, staticmethod or classmethod (decorators unwrapped), or None.
    An object whose attribute access raises (megatron's ``experimental_cls`` guard raises
    ExperimentalNotEnabledError for any attribute) is left as it is: routing must not break an import."""
    try:
        fn = raw.__func__ if type(raw) in (staticmethod, classmethod) else raw
        fn = inspect.unwrap(fn) if callable(fn) else None
        code = getattr(fn, "__code__", None)
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    return fn if isinstance(code, types.CodeType) else None


def _wrap(raw, module_name: str):
    if isinstance(raw, (staticmethod, classmethod)):
        return type(raw)(torch_view.routes_tensor_calls(raw.__func__, module_name))
    return torch_view.routes_tensor_calls(raw, module_name)


def _route_tensor_calls(module: types.ModuleType) -> list:
    """Wrap each function of ``module`` that spells CUDA in tensor methods; returns what was replaced."""
    wrapped, done, pins = [], {}, not backend.current().is_accelerator
    for owner, name, raw in _definitions(module):
        fn = _function(raw)
        if fn is None or getattr(raw, "__adapter_routed__", None) or not spells_tensor_calls(fn.__code__, pins):
            continue
        if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn):
            continue  # a mode entered in a generator would stay on while it is suspended
        setattr(owner, name, done.setdefault(id(raw), _wrap(raw, module.__name__)))
        wrapped.append((owner, name, raw))
    return wrapped


def _device_counterparts(module_name: str) -> dict:
    """id(routed object) -> real object, for what a routed module may hold from torch."""
    import torch.distributed as dist

    pairs = {id(torch_view.routed()): torch, id(torch_view.routed_strings()): torch,
             id(torch_view.routed_strings(distributed=False)): torch, id(torch_view.routed_backend()): torch,
             id(device): torch.cuda, id(torch_view.routed_distributed()): dist}
    for name in _TORCH_CUDA_FROM.get(module_name, ()):
        routed = getattr(device, name, None)
        if routed is not None and hasattr(torch.cuda, name):
            pairs[id(routed)] = getattr(torch.cuda, name)
    return pairs


def _record(module: types.ModuleType, had_builtins: bool, original_builtins) -> None:
    counterparts = _device_counterparts(module.__name__)
    names = {k: counterparts[id(v)] for k, v in vars(module).items() if id(v) in counterparts}
    _ROUTED[module.__name__] = _Routed(module, had_builtins, original_builtins, names,
                                       _route_tensor_calls(module))


def _route_imported(module: types.ModuleType) -> None:
    """Route a module imported before its package was: rebind its torch, torch.cuda and torch.cuda names
    (and torch.distributed, where it spells ``"nccl"`` or hands a backend on)."""
    namespace = vars(module)
    codes = [fn.__code__ for _, _, raw in _definitions(module) if (fn := _function(raw)) is not None]
    kinds = "+".join(map(view_kind, codes))
    _KINDS[module.__name__] = "+".join(k for k in ("strings", "dist") if k in kinds)
    view = _view(module.__name__, None)
    cuda_names = {id(v): k for k, v in vars(torch.cuda).items() if not isinstance(v, (int, str, bool, type(None)))}
    had_builtins, original_builtins = "__builtins__" in namespace, namespace.get("__builtins__")
    dist = sys.modules.get("torch.distributed") if "dist" in _KINDS[module.__name__] else None
    for key, value in list(namespace.items()):
        if value is torch:
            namespace[key] = view
        elif dist is not None and value is dist:
            namespace[key] = torch_view.routed_distributed()
        elif value is torch.cuda:
            namespace[key] = device
        elif id(value) in cuda_names and hasattr(device, cuda_names[id(value)]):
            _TORCH_CUDA_FROM.setdefault(module.__name__, set()).add(cuda_names[id(value)])
            namespace[key] = getattr(device, cuda_names[id(value)])
    namespace["__builtins__"] = _routed_builtins()
    _record(module, had_builtins, original_builtins)


def _module_functions(records) -> list:
    """(raw, wrapper) for the module-level functions the records wrapped: other modules may hold copies
    of them (``from .clip_grads import clip_grad_by_total_norm_fp32``)."""
    return [(raw, getattr(owner, name)) for r in records for owner, name, raw in r.wrapped
            if isinstance(owner, types.ModuleType)]


def _rebind_copies(pairs, package: str) -> None:
    """In each module of ``package``, rebind names bound by value to an old object to its new one; for
    ``pairs`` of (old, new)."""
    batch = {id(old): (old, new) for old, new in pairs}
    if not batch:
        return
    for name, module in list(sys.modules.items()):
        if not (name == package or name.startswith(package + ".")) or not isinstance(module, types.ModuleType):
            continue
        namespace = vars(module)
        for key, value in list(namespace.items()):
            hit = batch.get(id(value))
            if hit is not None and value is hit[0]:
                namespace[key] = hit[1]


def _unroute(record: _Routed) -> None:
    for owner, name, raw in reversed(record.wrapped):
        setattr(owner, name, raw)
    namespace = vars(record.module)
    namespace.update(record.names)
    if record.had_builtins:
        namespace["__builtins__"] = record.builtins
    else:
        namespace["__builtins__"] = builtins.__dict__


# ---------------------------------------------------------------------------------------- public
_NEVER_ROUTED = ("torch", "adapter", "builtins", "importlib")


def check_package_name(package: str, who: str) -> None:
    """Refuse what must not be routed, naming it: torch itself and the adapter (whose code is the routing),
    a name that is not a dotted package name, and megatron for anyone but the adapter (it routes all of
    megatron already; a user's unroute must not undo that)."""
    if not isinstance(package, str) or not all(part.isidentifier() for part in package.split(".")):
        raise ValueError(f"adapter.route_cuda: {package!r} is not a package name; give the dotted import name "
                         "of your own package, e.g. route_cuda('my_project')")
    top = package.partition(".")[0]
    if top in _NEVER_ROUTED or top in sys.stdlib_module_names:
        raise ValueError(f"adapter.route_cuda: {package!r} cannot be routed: only your own packages can "
                         "(torch, the standard library and the adapter stay as they are)")
    if top == "megatron" and who != "adapter":
        raise ValueError(f"adapter.route_cuda: {package!r} is routed by `import adapter` already; name only "
                         "your own packages")


def route(package: str, who: str = "user") -> None:
    """Route every module of ``package``, imported now or later (see the module docstring). Nothing on the
    cuda backend, where CUDA spellings are right as written."""
    check_package_name(package, who)
    if backend.current().name == "cuda":
        return
    with _LOCK:
        _SCOPES.set(package, who)
        if _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
        sys.meta_path.insert(0, _FINDER)
        routed_now = []
        for name, module in list(sys.modules.items()):
            if isinstance(module, types.ModuleType) and name not in _ROUTED and _SCOPES.covers(name):
                _route_imported(module)
                routed_now.append(_ROUTED[name])
        _rebind_copies(_module_functions(routed_now), package)


def unroute(package: str, who: str = "user") -> None:
    """Stop routing ``package``: its modules get back torch, torch.cuda and their own functions."""
    check_package_name(package, who)
    with _LOCK:
        _SCOPES.set(package, None)
        leaving = [n for n in _ROUTED if not _SCOPES.covers(n) and (n == package or n.startswith(package + "."))]
        _rebind_copies([(new, old) for old, new in _module_functions(_ROUTED[n] for n in leaving)], package)
        for name in leaving:
            _unroute(_ROUTED.pop(name))
            _KINDS.pop(name, None)
            _TORCH_CUDA_FROM.pop(name, None)
        if not _SCOPES.packages and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)


def routed_packages() -> dict[str, str]:
    """Routed package -> who asked for it."""
    return dict(_SCOPES.packages)


def is_routed(module: str) -> bool:
    return module in _ROUTED


def rows() -> list[dict]:
    """For the report: each routed package, its routed modules and wrapped functions."""
    return [{"package": package, "by": who,
             "modules": sum(1 for n in _ROUTED if n == package or n.startswith(package + ".")),
             "tensor-call functions": sum(len(r.wrapped) for n, r in _ROUTED.items()
                                          if n == package or n.startswith(package + "."))}
            for package, who in _SCOPES.packages.items()]


class Router:
    """What the registry's ``route`` patch installs and reverts."""

    def install(self, package: str) -> None:
        route(package, who="adapter")

    def uninstall(self, package: str) -> None:
        unroute(package, who="adapter")

    def installed(self, package: str) -> bool:
        return _SCOPES.packages.get(package) == "adapter"
