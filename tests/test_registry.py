"""PatchRegistry: unit tests on throw-away packages, and the real adapter on the real megatron-core.

The unit tests build a fresh top-level package per test under ``tmp_path``, with a uuid in its name:
wrapt's post-import hooks are process-global and cannot be unregistered, so no two tests may ever hook
the same module name. Each registry is built with a fixed backend ("cpu") and megatron version
("0.16.1") and searches only its own package for by-value copies.

The integration tests run in fresh interpreters, because which of adapter and megatron is imported first
matters and the adapter's patches are process-global.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import throwaway_package
from adapter.registry import (
    ALLOW_UNTESTED_ENV,
    PatchError,
    PatchRegistry,
    PatchTargetError,
    PatchVersionError,
)

ROOT = Path(__file__).resolve().parents[1]
VERSION = "0.16.1"
CHECKED = "==0.16.1"

TARGET_SRC = '''
CONST = ["the", "original", "constant"]
LIMIT = 7
HOOK = None


def f(x):
    return ("f", x)


class C:
    def method(self):
        return ("method", self)

    @classmethod
    def cm(cls):
        return ("cm", cls)

    @staticmethod
    def sm():
        return "sm"


class Sub(C):
    pass
'''

# by-value copies (from ... import ...) plus unrelated module globals that merely equal a target's value
USER_SRC = '''
from {pkg}.target import f, CONST, LIMIT
from {pkg}.target import f as renamed_f

OTHER_LIMIT = 7
UNSET = None


def call_f(x):
    return f(x)
'''


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True)
def _no_untested_override(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    """A fresh, not yet imported, uniquely named package with ``target`` and ``user`` modules."""
    with throwaway_package(tmp_path, monkeypatch, "fakepkg", {"target": TARGET_SRC, "user": USER_SRC}) as name:
        yield name


@pytest.fixture
def make_registry(pkg):
    """Registries for the ``pkg`` package; every one is reverted after the test."""
    made = []

    def make(backend="cpu", version=VERSION):
        reg = PatchRegistry(backend=lambda: backend, megatron_version=lambda: version, copy_scope=(pkg,))
        made.append(reg)
        return reg

    yield make
    for reg in made:
        reg.revert()


def imp(pkg, module):
    return importlib.import_module(f"{pkg}.{module}")


def new_f(x):
    return ("new_f", x)


def tracing_wrapper(tag, trace, built):
    """A registry wrapper that logs entry/exit into ``trace`` and counts how often it was applied."""

    def wrapper(fn):
        built.append(tag)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            trace.append(f"{tag}>")
            out = fn(*args, **kwargs)
            trace.append(f"<{tag}")
            return out

        return wrapped

    return wrapper


# ------------------------------------------------------------------------------------ apply and revert
def test_apply_revert_restores_identity_of_functions_methods_descriptors_and_constants(pkg, make_registry):
    target = imp(pkg, "target")
    C = target.C
    before = {"f": target.f, "CONST": target.CONST, **{k: C.__dict__[k] for k in ("method", "cm", "sm")}}

    def new_method(self):
        return ("new_method", self)

    def new_cm(cls):
        return ("new_cm", cls)

    def new_sm():
        return "new_sm"

    new_const = ["patched"]
    reg = make_registry()
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions=CHECKED)
    reg.replace(f"{pkg}.target:C.method", new_method, reason="r", versions=CHECKED)
    reg.replace(f"{pkg}.target:C.cm", new_cm, reason="r", versions=CHECKED)
    reg.replace(f"{pkg}.target:C.sm", new_sm, reason="r", versions=CHECKED)
    reg.replace(f"{pkg}.target:CONST", new_const, reason="r", versions=CHECKED)
    reg.apply()

    assert target.f is new_f and target.f(1) == ("new_f", 1)
    assert C.__dict__["method"] is new_method
    obj = C()
    assert obj.method() == ("new_method", obj)
    # the classmethod stays a classmethod around the plain function given
    assert type(C.__dict__["cm"]) is classmethod and C.__dict__["cm"].__func__ is new_cm
    assert C.cm() == ("new_cm", C)
    assert target.Sub.cm() == ("new_cm", target.Sub)
    assert type(C.__dict__["sm"]) is staticmethod and C.__dict__["sm"].__func__ is new_sm
    assert C.sm() == "new_sm" and obj.sm() == "new_sm"
    assert target.CONST is new_const
    for t in ("f", "C.method", "C.cm", "C.sm", "CONST"):
        assert reg.status(f"{pkg}.target:{t}") == "applied"
        assert reg.applied(f"{pkg}.target:{t}")

    reg.revert()

    assert target.f is before["f"] and target.f(1) == ("f", 1)
    assert target.CONST is before["CONST"]
    for k in ("method", "cm", "sm"):
        assert C.__dict__[k] is before[k], k
    assert C.cm() == ("cm", C) and C.sm() == "sm"
    assert not reg.applied(f"{pkg}.target:f")


def test_inherited_descriptor_targets_keep_their_kind_and_revert_by_deleting(pkg, make_registry):
    target = imp(pkg, "target")
    Sub, C = target.Sub, target.C
    c_cm, c_sm = C.__dict__["cm"], C.__dict__["sm"]

    def new_cm(cls):
        return ("new_cm", cls)

    def new_sm():
        return "new_sm"

    reg = make_registry()
    reg.replace(f"{pkg}.target:Sub.cm", new_cm, reason="r", versions=CHECKED)
    reg.replace(f"{pkg}.target:Sub.sm", new_sm, reason="r", versions=CHECKED)
    reg.apply()

    assert type(Sub.__dict__["cm"]) is classmethod and Sub.cm() == ("new_cm", Sub)
    assert type(Sub.__dict__["sm"]) is staticmethod and Sub().sm() == "new_sm"
    assert C.cm() == ("cm", C) and C.__dict__["cm"] is c_cm  # the base class is not touched

    reg.revert()
    assert "cm" not in Sub.__dict__ and "sm" not in Sub.__dict__
    assert C.__dict__["cm"] is c_cm and C.__dict__["sm"] is c_sm
    assert Sub.cm() == ("cm", Sub)


def test_by_value_copies_are_rebound_on_apply_and_restored_on_revert(pkg, make_registry):
    user = imp(pkg, "user")
    target = imp(pkg, "target")
    orig_f, orig_const = target.f, target.CONST
    assert user.f is orig_f and user.renamed_f is orig_f and user.CONST is orig_const

    new_const = ["patched"]
    reg = make_registry()
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions=CHECKED)
    reg.replace(f"{pkg}.target:CONST", new_const, reason="r", versions=CHECKED)
    reg.apply()

    assert user.f is new_f and user.renamed_f is new_f and user.CONST is new_const
    assert user.call_f(2) == ("new_f", 2)

    reg.revert()
    assert user.f is orig_f and user.renamed_f is orig_f and user.CONST is orig_const
    assert user.call_f(2) == ("f", 2)


def test_patches_registered_together_apply_as_the_block_ends_with_one_search_for_copies(pkg, make_registry):
    """On an applied registry (the hang watcher's wraps, made as the run starts) each registration would search
    every module for copies; ``together`` searches once for the module's patches, and they still reach the
    copies and revert like any other."""
    user, target = imp(pkg, "user"), imp(pkg, "target")
    orig_f, orig_const = target.f, target.CONST
    reg = make_registry()
    reg.apply()
    searches = []
    search = reg._rebind_copies
    reg._rebind_copies = lambda batch, *rest, **kw: (searches.append(len(batch)), search(batch, *rest, **kw))
    new_const = ["patched"]
    with reg.together():
        reg.replace(f"{pkg}.target:f", new_f, reason="r", versions=CHECKED)
        reg.replace(f"{pkg}.target:CONST", new_const, reason="r", versions=CHECKED)
        assert target.f is orig_f and reg.status(f"{pkg}.target:f") == "pending"  # not before the block ends
    assert searches == [2]
    assert target.f is new_f and user.f is new_f and user.renamed_f is new_f and user.CONST is new_const
    reg.revert()
    assert target.f is orig_f and user.f is orig_f and user.CONST is orig_const


def test_copy_rebinding_leaves_unrelated_equal_immutables_alone(pkg, make_registry):
    """Small ints and None are shared objects: an unrelated global that equals the target is no copy."""
    user = imp(pkg, "user")
    target = imp(pkg, "target")
    reg = make_registry()
    reg.replace(f"{pkg}.target:LIMIT", 11, reason="r", versions=CHECKED)
    reg.replace(f"{pkg}.target:HOOK", print, reason="r", versions=CHECKED)
    reg.apply()

    assert target.LIMIT == 11 and target.HOOK is print
    assert user.OTHER_LIMIT == 7
    assert user.UNSET is None
    # the flip side: a by-value copy of such a value cannot be told apart, so it is not rebound
    assert user.LIMIT == 7

    reg.revert()
    assert target.LIMIT == 7 and target.HOOK is None
    assert user.OTHER_LIMIT == 7 and user.UNSET is None and user.LIMIT == 7


# -------------------------------------------------------------------------------------- import orders
def test_apply_before_import_patches_on_import_and_revert_restores_later_copies(pkg, make_registry):
    reg = make_registry()
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions=CHECKED)
    reg.apply()
    assert f"{pkg}.target" not in sys.modules
    assert reg.status(f"{pkg}.target:f") == "pending"

    user = imp(pkg, "user")  # imports target, which the post-import hook patches before user copies f
    target = sys.modules[f"{pkg}.target"]
    assert reg.status(f"{pkg}.target:f") == "applied"
    assert target.f is new_f and user.f is new_f and user.renamed_f is new_f

    reg.revert()
    assert target.f is not new_f and target.f(3) == ("f", 3)
    # a copy taken while the patch was in place goes back to the original too
    assert user.f is target.f and user.renamed_f is target.f

    reg.apply()  # the module is imported now: apply patches at once, copies included
    assert target.f is new_f and user.f is new_f


def test_apply_after_import(pkg, make_registry):
    user = imp(pkg, "user")
    target = imp(pkg, "target")
    orig_f = target.f
    reg = make_registry()
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions=CHECKED)
    assert reg.status(f"{pkg}.target:f") == "pending"  # registered, not applied yet
    assert target.f is orig_f
    reg.apply()
    assert reg.status(f"{pkg}.target:f") == "applied"
    assert target.f is new_f and user.f is new_f


def test_apply_twice_changes_nothing(pkg, make_registry):
    user = imp(pkg, "user")
    target = imp(pkg, "target")
    orig_f = target.f
    trace, built = [], []
    reg = make_registry()
    reg.wrap(f"{pkg}.target:f", tracing_wrapper("w", trace, built), reason="r", versions=CHECKED)
    reg.replace(f"{pkg}.target:C.cm", lambda cls: ("new_cm", cls), reason="r", versions=CHECKED)
    reg.apply()
    first_f, first_cm = target.f, target.C.__dict__["cm"]
    reg.apply()

    assert built == ["w"]  # the wrapper factory ran once
    assert target.f is first_f and user.f is first_f and target.C.__dict__["cm"] is first_cm
    assert target.f.__wrapped__ is orig_f  # not wrapped around its own wrapper
    assert target.f(5) == ("f", 5) and trace == ["w>", "<w"]

    reg.revert()
    assert target.f is orig_f and user.f is orig_f


# ------------------------------------------------------------------------------------ wrapper stacking
def test_wrappers_stack_on_the_replacement_first_registered_innermost(pkg, make_registry):
    target = imp(pkg, "target")
    orig_f = target.f
    trace, built = [], []

    def r(x):
        trace.append("r")
        return ("r", x)

    reg = make_registry()
    # the replacement is innermost even when a wrapper is registered before it
    reg.wrap(f"{pkg}.target:f", tracing_wrapper("w1", trace, built), reason="r", versions=CHECKED)
    reg.replace(f"{pkg}.target:f", r, reason="r", versions=CHECKED)
    reg.wrap(f"{pkg}.target:f", tracing_wrapper("w2", trace, built), reason="r", versions=CHECKED)
    reg.apply()

    assert built == ["w1", "w2"]
    assert target.f(1) == ("r", 1)
    assert trace == ["w2>", "w1>", "r", "<w1", "<w2"]  # w2(w1(r))
    assert target.f.__wrapped__.__wrapped__ is r

    reg.revert()
    assert target.f is orig_f


def test_a_wrapper_alone_wraps_the_original(pkg, make_registry):
    target = imp(pkg, "target")
    orig_f, orig_cm = target.f, target.C.__dict__["cm"]
    trace, built = [], []
    reg = make_registry()
    reg.wrap(f"{pkg}.target:f", tracing_wrapper("w", trace, built), reason="r", versions=CHECKED)
    reg.wrap(f"{pkg}.target:C.cm", tracing_wrapper("wc", trace, built), reason="r", versions=CHECKED)
    reg.apply()

    assert target.f.__wrapped__ is orig_f
    assert target.f(4) == ("f", 4) and trace == ["w>", "<w"]
    # a classmethod target: the wrapper gets the plain function and the result is a classmethod again
    assert type(target.C.__dict__["cm"]) is classmethod
    assert target.C.__dict__["cm"].__func__.__wrapped__ is orig_cm.__func__
    assert target.C.cm() == ("cm", target.C) and trace[-2:] == ["wc>", "<wc"]

    reg.revert()
    assert target.f is orig_f and target.C.__dict__["cm"] is orig_cm


# ------------------------------------------------------------------------------- backends and conflicts
def test_two_replacements_on_overlapping_backends_are_an_error(pkg, make_registry):
    reg = make_registry()
    reg.replace(f"{pkg}.target:f", new_f, reason="first", versions=CHECKED, backends=("cpu", "npu"))
    with pytest.raises(PatchError, match=f"{pkg}.target:f") as info:
        reg.replace(f"{pkg}.target:f", lambda x: x, reason="second", versions=CHECKED, backends=("npu",))
    assert "npu" in str(info.value) and "first" in str(info.value) and "second" in str(info.value)
    assert [p.reason for p in reg.patches()] == ["first"]  # the rejected one is not kept


def test_two_replacements_on_disjoint_backends_apply_per_backend(pkg, make_registry):
    target = imp(pkg, "target")
    orig_f = target.f

    def on_accel(x):
        return ("accel", x)

    for backend, expected in (("cpu", new_f), ("npu", on_accel), ("cuda", on_accel)):
        reg = make_registry(backend=backend)
        reg.replace(f"{pkg}.target:f", new_f, reason="cpu", versions=CHECKED, backends=("cpu",))
        reg.replace(f"{pkg}.target:f", on_accel, reason="accel", versions=CHECKED, backends=("npu", "cuda"))
        reg.apply()
        assert target.f is expected, backend
        reg.revert()
        assert target.f is orig_f


def test_patch_for_another_backend_is_not_applied(pkg, make_registry):
    target = imp(pkg, "target")
    orig_f = target.f
    reg = make_registry()
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions=CHECKED, backends=("npu",))
    reg.apply()
    assert target.f is orig_f
    assert reg.status(f"{pkg}.target:f") == "not for cpu"
    assert not reg.applied(f"{pkg}.target:f")


# ----------------------------------------------------------------------------- missing targets, versions
@pytest.mark.parametrize("attr", ["missing_function", "C.missing_method", "Missing.method"])
def test_missing_target_is_a_target_error_naming_target_and_version(pkg, make_registry, attr):
    imp(pkg, "target")
    reg = make_registry()
    target = f"{pkg}.target:{attr}"
    reg.replace(target, new_f, reason="r", versions=CHECKED)
    with pytest.raises(PatchTargetError) as info:
        reg.apply()
    assert target in str(info.value) and VERSION in str(info.value)
    assert reg.status(target).startswith("error:")


def test_missing_target_raises_at_import_when_applied_before_import(pkg, make_registry):
    reg = make_registry()
    target = f"{pkg}.target:missing_function"
    reg.replace(target, new_f, reason="r", versions=CHECKED)
    reg.apply()
    with pytest.raises(PatchTargetError, match=target):
        imp(pkg, "target")


def test_optional_missing_target_is_skipped(pkg, make_registry):
    target_mod = imp(pkg, "target")
    reg = make_registry()
    missing = f"{pkg}.target:missing_function"
    reg.replace(missing, new_f, reason="r", versions=CHECKED, optional=True)
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions=CHECKED)
    reg.apply()
    assert reg.status(missing).startswith("skipped")
    assert missing in reg.status(missing)
    assert not hasattr(target_mod, "missing_function")
    assert target_mod.f is new_f  # the other patch of the module still went in


def test_version_guard_refuses_untested_megatron(pkg, make_registry):
    target = imp(pkg, "target")
    orig_f = target.f
    reg = make_registry()
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions="==0.15.0")
    with pytest.raises(PatchVersionError) as info:
        reg.apply()
    message = str(info.value)
    assert "0.15.0" in message and VERSION in message and ALLOW_UNTESTED_ENV in message
    assert ALLOW_UNTESTED_ENV == "ADAPTER_ALLOW_UNTESTED_MEGATRON"
    assert target.f is orig_f


def test_version_guard_override_env_applies(pkg, make_registry, monkeypatch):
    target = imp(pkg, "target")
    monkeypatch.setenv("ADAPTER_ALLOW_UNTESTED_MEGATRON", "1")
    reg = make_registry()
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions="==0.15.0")
    reg.apply()
    assert target.f is new_f and reg.status(f"{pkg}.target:f") == "applied"


def test_non_strict_apply_records_errors_and_applies_the_rest(pkg, make_registry):
    target = imp(pkg, "target")
    reg = make_registry()
    missing = f"{pkg}.target:missing_function"
    untested = f"{pkg}.target:C.method"
    reg.replace(missing, new_f, reason="r", versions=CHECKED)
    reg.replace(untested, new_f, reason="r", versions="==0.15.0")
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions=CHECKED)
    reg.apply(strict=False)  # does not raise

    assert reg.status(missing).startswith("error:") and missing in reg.status(missing)
    assert reg.status(untested).startswith("error:") and "0.15.0" in reg.status(untested)
    assert target.f is new_f and reg.status(f"{pkg}.target:f") == "applied"
    assert target.C.__dict__["method"] is not new_f


# ---------------------------------------------------------------------------------- bad registrations
@pytest.mark.parametrize("kwargs, fragment", [
    ({"target": "pkg.target.f"}, "colon"),
    ({"target": ":f"}, "colon"),
    ({"target": "pkg.target:"}, "colon"),
    ({"target": "pkg.target:C..m"}, "colon"),
    ({"reason": "first line\nsecond line"}, "one-line reason"),
    ({"reason": ""}, "one-line reason"),
    ({"reason": "   "}, "one-line reason"),
    ({"backends": ("cpu", "tpu")}, "tpu"),
    ({"backends": ()}, "non-empty"),
    ({"versions": "0.16 or newer"}, "version specifier"),
])
@pytest.mark.parametrize("method", ["replace", "wrap"])
def test_bad_registrations_are_refused(kwargs, fragment, method):
    reg = PatchRegistry(backend=lambda: "cpu", megatron_version=lambda: VERSION, copy_scope=("nothing",))
    args = {"target": "pkg.target:f", "reason": "why", "versions": CHECKED, "backends": ("cpu",), **kwargs}
    target = args.pop("target")
    with pytest.raises(PatchError, match=fragment):
        getattr(reg, method)(target, lambda fn: fn, **args)
    assert reg.patches() == []


def test_registering_on_an_applied_target_is_refused(pkg, make_registry):
    target = imp(pkg, "target")
    reg = make_registry()
    reg.replace(f"{pkg}.target:f", new_f, reason="r", versions=CHECKED)
    reg.apply()
    with pytest.raises(PatchError, match="already patched"):
        reg.wrap(f"{pkg}.target:f", lambda fn: fn, reason="late", versions=CHECKED)
    assert target.f is new_f


# ------------------------------------------------------------------- the real adapter on megatron-core
REAL_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch

    TORCH_CUDA = torch.cuda
    CURRENT_DEVICE = torch.cuda.current_device
    ROUTE = "megatron:*"  # the rule that routes every megatron module (adapter.cuda_routing)
    SCALE = "megatron.core.utils:local_multi_tensor_scale"

    if sys.argv[1] == "adapter-first":
        import adapter
        import megatron.core.optimizer.optimizer as o
        import megatron.core.pipeline_parallel.schedules as s
        import megatron.core.optimizer.clip_grads as cg
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as DO
        # patched since import: the originals are what the wrappers wrap
        ORIG_CLIP = cg.clip_grad_by_total_norm_fp32.__wrapped__
        ORIG_INIT = DO.__dict__["__init__"].__wrapped__
    else:
        import megatron.core.optimizer.optimizer as o
        import megatron.core.pipeline_parallel.schedules as s
        import megatron.core.optimizer.clip_grads as cg
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params as DO
        ORIG_CLIP = cg.clip_grad_by_total_norm_fp32
        ORIG_INIT = DO.__dict__["__init__"]
        assert s.torch is torch and o.clip_grad_by_total_norm_fp32 is ORIG_CLIP
        import adapter

    def state():
        clip = cg.clip_grad_by_total_norm_fp32
        out = {
            "sched_torch_is_torch": s.torch is torch,
            "sched_cuda_is_adapter_device": s.torch.cuda is adapter.device,
            "copy_is_clip": o.clip_grad_by_total_norm_fp32 is clip,
            "clip_is_original": clip is ORIG_CLIP,
            "clip_wraps_original": getattr(clip, "__wrapped__", None) is ORIG_CLIP,
            "original_is_megatrons": (ORIG_CLIP.__module__, ORIG_CLIP.__qualname__,
                                      hasattr(ORIG_CLIP, "__wrapped__")),
            "init_is_original": DO.__dict__["__init__"] is ORIG_INIT,
            "init_wraps_original": getattr(DO.__dict__["__init__"], "__wrapped__", None) is ORIG_INIT,
            "torch_cuda_untouched": torch.cuda is TORCH_CUDA and torch.cuda.current_device is CURRENT_DEVICE,
            "status": [adapter.registry.status(ROUTE), adapter.registry.status(SCALE)],
            "backend": adapter.current_backend().name,
        }
        if not out["sched_torch_is_torch"]:
            out["zeros_device"] = s.torch.zeros([1], device="cuda").device.type
        return out

    result = {"applied": state()}
    adapter.revert()
    result["reverted"] = state()
    adapter.apply()
    result["reapplied"] = state()
    print("RESULT " + json.dumps(result))
''')


@pytest.mark.slow
@pytest.mark.parametrize("order", ["adapter-first", "megatron-first"])
def test_real_adapter_on_megatron_core(order):
    env = {k: v for k, v in os.environ.items() if k != ALLOW_UNTESTED_ENV}
    env["ADAPTER_BACKEND"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", REAL_SCRIPT, order], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-4000:]
    result = json.loads(lines[0][len("RESULT "):])
    megatrons = ["megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32", False]

    for phase in ("applied", "reapplied"):
        st = result[phase]
        assert st["backend"] == "cpu"
        assert st["sched_torch_is_torch"] is False, phase
        assert st["sched_cuda_is_adapter_device"] is True, phase
        assert st["zeros_device"] == "cpu", phase
        assert st["copy_is_clip"] is True, phase  # the by-value copy in optimizer.py follows the patch
        assert st["clip_is_original"] is False, phase
        assert st["clip_wraps_original"] is True, phase
        assert st["original_is_megatrons"] == megatrons
        assert st["init_is_original"] is False and st["init_wraps_original"] is True, phase
        assert st["torch_cuda_untouched"] is True, phase
        assert st["status"] == ["applied", "applied"], phase

    st = result["reverted"]
    assert st["sched_torch_is_torch"] is True
    assert st["clip_is_original"] is True
    assert st["copy_is_clip"] is True  # optimizer.py holds the original again, whichever import order
    assert st["init_is_original"] is True
    assert st["torch_cuda_untouched"] is True
    assert st["status"] == ["pending", "pending"]


# ------------------------------------------------------------------------------------ names left unbound
def test_a_name_megatron_leaves_unbound_is_bound_and_reverted(pkg, make_registry):
    target_mod = imp(pkg, "target")
    reg = make_registry()
    reg.bind(f"{pkg}.target:te_gemm", None, reason="r", versions=CHECKED)
    reg.apply()
    assert reg.status(f"{pkg}.target:te_gemm") == "applied"
    assert target_mod.te_gemm is None
    reg.revert()
    assert not hasattr(target_mod, "te_gemm")


def test_a_name_megatron_binds_to_none_counts_as_unbound(pkg, make_registry):
    """megatron-core 0.17+ binds an optional library's missing names to None (moe_utils' fused_permute):
    the bind goes over None, and revert puts None back, not a missing name."""
    target_mod = imp(pkg, "target")
    stand_in = object()
    reg = make_registry()
    reg.bind(f"{pkg}.target:HOOK", stand_in, reason="r", versions=CHECKED)
    reg.apply()
    assert reg.status(f"{pkg}.target:HOOK") == "applied"
    assert target_mod.HOOK is stand_in
    reg.revert()
    assert "HOOK" in vars(target_mod) and target_mod.HOOK is None


def test_a_name_megatron_bound_is_left_alone(pkg, make_registry):
    target_mod = imp(pkg, "target")
    original = target_mod.f
    reg = make_registry()
    reg.bind(f"{pkg}.target:f", None, reason="r", versions=CHECKED)
    reg.apply()
    assert target_mod.f is original
    assert reg.status(f"{pkg}.target:f") == "skipped: f is bound by megatron here: nothing to bind"


def test_a_bound_name_takes_no_other_patch(pkg, make_registry):
    reg = make_registry()
    reg.bind(f"{pkg}.target:te_gemm", None, reason="r", versions=CHECKED)
    with pytest.raises(PatchError, match="takes no other patch"):
        reg.wrap(f"{pkg}.target:te_gemm", lambda fn: fn, reason="r2", versions=CHECKED)
