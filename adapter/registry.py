"""The patch registry: every change the adapter makes to megatron-core goes through here.

A patch names its target as ``"package.module:Owner.attr"``. The colon marks where the module ends, so
the registry can hook the module before it is imported (``import adapter`` comes before megatron)
without importing anything to find out which prefix is a module. Each patch carries a one-line reason,
the backends it applies to and the megatron-core versions it was checked against.

Guarantees, each covered by tests/test_registry.py:
- applying twice changes nothing; ``revert()`` puts back the very objects that were there;
- copies bound by value elsewhere (``from x import f``) are rebound, and restored on revert, also
  those taken while patched; not for shared immutables (None, small ints, strings: ``is`` proves nothing);
- wrappers stack on the replacement (or the original) in registration order, first registered innermost;
- two replacements of one target, or a target the installed megatron-core lacks, are clear errors;
- a ``bind`` fills a name megatron left unbound or bound to None, and revert puts back exactly that.

A ``route`` patch (target ``"package:*"``) changes no attribute: it hands every module of the package,
imported now or later, to a router (``adapter.cuda_routing``) on apply and takes it back on revert.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import os
import sys
import threading
import warnings
from typing import Any, Callable, Iterable

import wrapt
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

ALL_BACKENDS = frozenset({"cpu", "cuda", "npu"})
ALLOW_UNTESTED_ENV = "ADAPTER_ALLOW_UNTESTED_MEGATRON"


class PatchError(RuntimeError):
    """A patch cannot be registered or applied as declared."""


class PatchTargetError(PatchError):
    """The target does not exist in the installed megatron-core."""


class PatchVersionError(PatchError):
    """The installed megatron-core is outside the versions a patch was checked against."""


@dataclasses.dataclass(frozen=True)
class Patch:
    target: str
    new: Any
    reason: str
    kind: str  # "replace", "wrap", "bind" or "route"
    backends: frozenset
    versions: str
    optional: bool = False
    rebind_copies: bool = True

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def attr_path(self) -> list[str]:
        return self.target.partition(":")[2].split(".")


@dataclasses.dataclass
class _Applied:
    """What one target looked like before patching, so revert can restore it exactly."""

    owner: Any
    name: str
    had_own: bool  # the owner held the attribute itself (not inherited)
    original_raw: Any  # as stored in the owner's __dict__ (keeps classmethod/staticmethod wrappers)
    original: Any  # as seen through getattr: what by-value copies elsewhere would hold
    copies: list  # (module_dict, key) pairs rebound from original to the patched value
    patched: Any = None  # as seen through getattr after patching; set when copies are rebound
    rebound: bool = False  # copies of the original were rebound, so revert looks for copies again


# Objects the interpreter shares (None, small ints, interned strings, ...): a module global that `is`
# one of them is not necessarily a copy of the target, so copies of these are never rebound.
_SHARED_IMMUTABLES = frozenset({type(None), bool, int, float, complex, str, bytes, tuple, frozenset,
                                type(Ellipsis), type(NotImplemented)})


def _copies_traceable(value: Any) -> bool:
    return type(value) not in _SHARED_IMMUTABLES


def _descriptor_kind(raw: Any) -> type | None:
    return type(raw) if isinstance(raw, (classmethod, staticmethod)) else None


class PatchRegistry:
    def __init__(self, backend: Callable[[], str], megatron_version: Callable[[], str] | None = None,
                 copy_scope: tuple[str, ...] = ("megatron",)):
        """``copy_scope``: the top-level packages whose modules are searched for by-value copies."""
        self._backend = backend
        self._copy_scope = copy_scope
        self._megatron_version = megatron_version or installed_megatron_core_version
        self._patches: dict[str, list[Patch]] = {}
        self._applied: dict[str, _Applied] = {}
        self._skipped: dict[str, str] = {}
        self._errors: dict[str, str] = {}
        self._hooked: set[str] = set()
        self._routed: dict[str, Patch] = {}
        self._active = False
        self._lock = threading.RLock()
        self._held: set[str] | None = None  # inside ``together``: the modules whose patches wait for its end
        self.supported = ""  # the megatron-core releases of check_release: what a patch registered later declares

    # ------------------------------------------------------------------ registration
    def replace(self, target: str, new: Any, *, reason: str, versions: str,
                backends: Iterable[str] = ALL_BACKENDS, optional: bool = False,
                rebind_copies: bool = True) -> None:
        """Register ``new`` to stand in for ``target``. For a classmethod/staticmethod target give the
        plain function: the registry keeps the original descriptor kind."""
        self._register(Patch(target, new, reason, "replace", frozenset(backends), versions,
                             optional, rebind_copies))

    def wrap(self, target: str, wrapper: Callable[[Any], Any], *, reason: str, versions: str,
             backends: Iterable[str] = ALL_BACKENDS, optional: bool = False) -> None:
        """Register ``wrapper(fn) -> fn`` around ``target`` (around its replacement, if there is one)."""
        self._register(Patch(target, wrapper, reason, "wrap", frozenset(backends), versions, optional))

    def bind(self, target: str, value: Any, *, reason: str, versions: str,
             backends: Iterable[str] = ALL_BACKENDS) -> None:
        """Register ``value`` for a module-level name that megatron's import leaves unbound: an
        ``except ImportError`` branch that forgets one of the names its ``try`` imports from an optional
        library, or (megatron-core 0.17+) binds it to None. Where megatron bound it to something else (the
        library is there), nothing changes and the status says so."""
        self._register(Patch(target, value, reason, "bind", frozenset(backends), versions, optional=True,
                             rebind_copies=False))

    def route(self, package: str, router, *, reason: str, versions: str,
              backends: Iterable[str] = ALL_BACKENDS) -> None:
        """Register ``router`` (``install(package)`` / ``uninstall(package)`` / ``installed(package)``) for
        every module of ``package``, whichever modules it has: the target is ``"package:*"``."""
        self._register(Patch(f"{package}:*", router, reason, "route", frozenset(backends), versions))

    def _register(self, patch: Patch) -> None:
        module, sep, attrs = patch.target.partition(":")
        if not sep or not module or not attrs or not all(attrs.split(".")) or (attrs == "*") != (
                patch.kind == "route"):
            raise PatchError(
                f"patch target {patch.target!r} must read 'package.module:Attr[.attr]', "
                "with a colon where the module path ends")
        if not patch.reason.strip() or "\n" in patch.reason.strip():
            raise PatchError(f"patch {patch.target}: give a one-line reason")
        unknown = patch.backends - ALL_BACKENDS
        if unknown or not patch.backends:
            raise PatchError(f"patch {patch.target}: backends {sorted(patch.backends)} must be a "
                             f"non-empty subset of {sorted(ALL_BACKENDS)}")
        try:
            SpecifierSet(patch.versions)
        except InvalidSpecifier as exc:
            raise PatchError(f"patch {patch.target}: versions {patch.versions!r} is not a version "
                             "specifier such as '>=0.16.0,<0.17'") from exc
        with self._lock:
            stack = self._patches.setdefault(patch.target, [])
            if "bind" in {patch.kind, *(other.kind for other in stack)} and stack:
                raise PatchError(f"{patch.target}: a name bound where megatron leaves it unbound takes no "
                                 f"other patch ('{patch.reason}')")
            if patch.kind == "replace":
                for other in stack:
                    if other.kind == "replace" and other.backends & patch.backends:
                        raise PatchError(
                            f"two replacements registered for {patch.target} on backends "
                            f"{sorted(other.backends & patch.backends)}: '{other.reason}' and "
                            f"'{patch.reason}'. Make one of them a wrapper, or drop one.")
            if patch.target in self._applied:
                raise PatchError(f"{patch.target} is already patched: register before apply(), "
                                 "or revert() first")
            stack.append(patch)
            if self._active and self._held is not None:
                self._held.add(patch.module)
            elif self._active:
                self._hook(patch.module)

    @contextlib.contextmanager
    def together(self):
        """Patches registered in this block on an active registry are applied together as it ends: one
        search of megatron's modules for by-value copies of what they replace for each module they patch,
        not one per patch (about 5 ms a search once megatron.training is imported: the hang watcher's 22
        wraps took 0.1 s of its start one by one). The block holds the registry: it only registers."""
        with self._lock:
            if self._held is not None:  # inside another block: applied as the outermost ends
                yield
                return
            self._held = set()
            try:
                yield
            finally:
                held, self._held = self._held, None
                for module in sorted(held):
                    self._hook(module)

    # ------------------------------------------------------------------ inspection
    def patches(self) -> list[Patch]:
        return [p for stack in self._patches.values() for p in stack]

    def status(self, target: str) -> str:
        """'applied', 'pending' (module not imported yet), 'not for <backend>', 'skipped: ...' or 'error: ...'."""
        if target in self._applied or target in self._routed:
            return "applied"
        if target in self._errors:
            return "error: " + self._errors[target]
        if target in self._skipped:
            return "skipped: " + self._skipped[target]
        if not self._active_stack(target):
            return f"not for {self._backend()}"
        return "pending"

    def megatron_version(self) -> str:
        """The megatron-core release this registry decides its patches' ``versions`` on."""
        return self._megatron_version()

    def applied(self, target: str) -> bool:
        return target in self._applied or target in self._routed

    def check_release(self, versions: str, checked_on: tuple[str, ...]) -> None:
        """Refuse, before any patch goes in, a megatron-core outside the supported ``versions``, in one line
        naming the releases the table was ``checked_on``; with ADAPTER_ALLOW_UNTESTED_MEGATRON=1 go on with
        a warning saying the same."""
        self.supported = versions
        installed = self._megatron_version()
        if _version_allowed(installed, versions):
            return
        message = (f"megatron-core {installed} is installed; the adapter supports megatron-core{versions} "
                   f"(checked on {', '.join(checked_on)})")
        if os.environ.get(ALLOW_UNTESTED_ENV) == "1":
            warnings.warn(f"{message}: trying it anyway ({ALLOW_UNTESTED_ENV}=1)", stacklevel=2)
            return
        raise PatchVersionError(f"{message}. Install one (pip install 'megatron-core{versions}'), or set "
                                f"{ALLOW_UNTESTED_ENV}=1 to try it anyway.")

    def checked(self, versions: str) -> bool:
        """Whether a change declared for megatron-core ``versions`` may go in here: the installed
        megatron-core is one of them, or ADAPTER_ALLOW_UNTESTED_MEGATRON=1. The rule for every patch, and
        for the adapter's changes that cannot be registry patches (adapter.stand_ins)."""
        return os.environ.get(ALLOW_UNTESTED_ENV) == "1" or _version_allowed(self._megatron_version(), versions)

    # ------------------------------------------------------------------ apply / revert
    def apply(self, strict: bool = True) -> None:
        """Patch every target whose module is imported now, and hook the rest to be patched on import.

        With ``strict=False`` failures are recorded (see ``status``) instead of raised, which is what
        the environment report wants."""
        with self._lock:
            self._active = True
            self._strict = strict
            for patch in self.patches():
                if patch.kind == "route":
                    self._route(patch)
            for module in sorted({p.module for p in self.patches() if p.kind != "route"}):
                self._hook(module)

    def revert(self) -> None:
        """Restore every patched object, copies included, and disarm the import hooks."""
        with self._lock:
            self._active = False
            records = [self._applied.pop(target) for target in reversed(list(self._applied))]
            for record in records:
                self._restore(record)
            for target, patch in reversed(list(self._routed.items())):
                patch.new.uninstall(patch.module)
                del self._routed[target]
            # copies taken while patched (modules imported after apply) go back to the original too
            self._rebind_copies({id(r.patched): (r.patched, r.original, r) for r in records
                                 if r.rebound and _copies_traceable(r.patched)}, record=False)
            self._skipped.clear()
            self._errors.clear()

    def _version_error(self, patch: Patch) -> PatchVersionError:
        return PatchVersionError(
            f"patch {patch.target} was checked against megatron-core {patch.versions}, but megatron-core "
            f"{self._megatron_version()} is installed. Install a checked version (pip install "
            f"'megatron-core{patch.versions}'), or set {ALLOW_UNTESTED_ENV}=1 to try it anyway.")

    def _route(self, patch: Patch) -> None:
        if patch.target in self._routed or self._backend() not in patch.backends:
            return
        if not self.checked(patch.versions):
            error = self._version_error(patch)
            self._errors[patch.target] = str(error)
            if self._strict:
                raise error
            return
        patch.new.install(patch.module)
        self._routed[patch.target] = patch

    def _hook(self, module: str) -> None:
        if module in self._hooked:
            if module in sys.modules:
                self._on_import(sys.modules[module])
            return
        self._hooked.add(module)
        # wrapt calls the hook at once when the module is already imported.
        wrapt.register_post_import_hook(self._on_import, module)

    def _on_import(self, module) -> None:
        with self._lock:
            if not self._active:
                return
            batch: dict[int, Any] = {}
            applied_now: list[_Applied] = []
            for target, stack in self._patches.items():
                if stack[0].module != module.__name__ or target in self._applied or stack[0].kind == "route":
                    continue
                if target in self._skipped or target in self._errors:
                    continue
                active = self._active_stack(target)
                if not active:
                    continue
                try:
                    record = self._apply_one(module, target, active)
                except PatchError as exc:
                    if all(p.optional for p in active):
                        self._skipped[target] = str(exc)
                        continue
                    self._errors[target] = str(exc)
                    if self._strict:
                        raise
                    continue
                applied_now.append(record)
                if all(p.rebind_copies for p in active) and _copies_traceable(record.original):
                    record.patched = getattr(record.owner, record.name)
                    record.rebound = True
                    batch[id(record.original)] = (record.original, record.patched, record)
            if batch:
                self._rebind_copies(batch)

    def _active_stack(self, target: str) -> list[Patch]:
        backend = self._backend()
        return [p for p in self._patches.get(target, ()) if backend in p.backends]

    def _apply_one(self, module, target: str, stack: list[Patch]) -> _Applied:
        version = self._megatron_version()
        for patch in stack:
            if not self.checked(patch.versions):
                raise self._version_error(patch)
        owner = module
        *path, name = stack[0].attr_path
        for part in path:
            if not hasattr(owner, part):
                raise PatchTargetError(
                    f"patch target {target}: {module.__name__} has no {'.'.join(path)} in the installed "
                    f"megatron-core {version}. The adapter needs a megatron-core it was checked against.")
            owner = getattr(owner, part)
        own = vars(owner) if hasattr(owner, "__dict__") else {}
        had_own = name in own
        if stack[0].kind == "bind":
            return self._bind_one(owner, name, target, stack[0], had_own)
        if not had_own and not hasattr(owner, name):
            raise PatchTargetError(
                f"patch target {target}: {name} does not exist in the installed megatron-core {version}. "
                "The adapter needs a megatron-core it was checked against.")
        if had_own:
            original_raw = own[name]
        elif isinstance(owner, type):  # inherited: the base's raw entry keeps classmethod/staticmethod
            original_raw = inspect.getattr_static(owner, name)
        else:
            original_raw = getattr(owner, name)
        original = getattr(owner, name)
        descriptor = _descriptor_kind(original_raw)
        current = original_raw.__func__ if descriptor else original_raw
        for patch in (p for p in stack if p.kind == "replace"):
            current = patch.new
        for patch in (p for p in stack if p.kind == "wrap"):
            current = patch.new(current)
        installed = descriptor(current) if descriptor else current
        setattr(owner, name, installed)
        record = _Applied(owner, name, had_own, original_raw, original, [])
        self._applied[target] = record
        return record

    def _bind_one(self, owner, name: str, target: str, patch: Patch, had_own: bool) -> _Applied:
        """A name bound to None counts as unbound: megatron-core 0.16 leaves an optional library's names out
        of its ``except ImportError`` branch, 0.17+ binds them to None there (moe_utils' fused permutation),
        and either way megatron reads the name as "the library is missing". Revert puts back what was
        there: no name, or None."""
        if getattr(owner, name, None) is not None:  # optional: recorded as skipped, with this reason
            raise PatchTargetError(f"{name} is bound by megatron here: nothing to bind")
        setattr(owner, name, patch.new)
        record = _Applied(owner, name, had_own, None, None, [])
        self._applied[target] = record
        return record

    def _rebind_copies(self, batch: dict[int, Any], record: bool = True) -> None:
        """Rebind names that megatron modules bound by value: ``batch`` maps id(old) to
        (old, new, applied record); ``record`` keeps the rebound names in the record for revert."""
        if not batch:
            return
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or mod_name.partition(".")[0] not in self._copy_scope:
                continue
            namespace = getattr(mod, "__dict__", None)
            # most modules hold none: asked in C, not a Python loop per name (every module, every batch)
            if not namespace or batch.keys().isdisjoint(map(id, list(namespace.values()))):
                continue
            for key, value in list(namespace.items()):
                hit = batch.get(id(value))
                if hit is None:
                    continue
                old, new, applied = hit
                if value is not old or (namespace is vars(applied.owner) and key == applied.name):
                    continue
                namespace[key] = new
                if record:
                    applied.copies.append((namespace, key))

    @staticmethod
    def _restore(record: _Applied) -> None:
        for namespace, key in record.copies:
            namespace[key] = record.original
        if record.had_own:
            setattr(record.owner, record.name, record.original_raw)
        else:
            delattr(record.owner, record.name)


def _version_allowed(version: str, spec: str) -> bool:
    return Version(version) in SpecifierSet(spec, prereleases=True)


@functools.lru_cache(maxsize=None)
def installed_megatron_core_version() -> str:
    """The installed megatron-core's version: what every patch's ``versions`` and every per-release
    branch of the adapter (``patches``, the training flow, models) are decided on."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        # A Megatron-LM checkout on PYTHONPATH: its package_info is the authority.
        return importlib.import_module("megatron.core.package_info").__version__
