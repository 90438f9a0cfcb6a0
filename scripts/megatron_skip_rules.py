"""Which of Megatron-LM's unit tests need what no CPU has, and why: the rules of
``scripts/run_megatron_tests.py``.

A test is skipped before it runs when its own code (the test function, its class's set-up) or its
parameters ask for Transformer Engine, FP8/FP4, CUDA graphs, Triton or apex. The decision reads only the
test's source text and parameter values, never the machine or the rank, so every rank skips the same
tests: a rank that skipped a test whose collectives the others entered would hang them.

A test these rules let through may still fail only because such a library is missing (a helper deep in
megatron imports it); ``missing_library`` recognises those failures from the error text, so they are
reported as skips naming the library, never as passes. ``not_installable_library`` does the same, under
its own prefix, for a library that is not CUDA-only but that this Python cannot install.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
import sys
import types

PREFIX = "CUDA-only: "  # starts every skip reason these rules give

# importable name -> what it is: libraries that need CUDA (or are CUDA kernels themselves)
CUDA_ONLY_LIBRARIES = {
    "transformer_engine": "Transformer Engine", "transformer_engine_torch": "Transformer Engine",
    "apex": "apex's CUDA extensions", "amp_C": "apex's CUDA extensions", "triton": "Triton",
    "flash_attn": "flash-attn", "flash_attn_3": "flash-attn 3", "flashattn_hopper": "flash-attn 3",
    "grouped_gemm": "grouped_gemm (CUDA kernels)", "deep_ep": "DeepEP", "flashinfer": "FlashInfer",
    "nvidia_resiliency_ext": "NVIDIA Resiliency Extension", "fast_hadamard_transform": "fast-hadamard-transform",
    "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d", "modelopt": "NVIDIA ModelOpt",
    "cupy": "CuPy", "nvshmem": "NVSHMEM", "cudnn": "cuDNN frontend", "tilelang": "TileLang",
}

# Libraries that are not CUDA-only but cannot be installed on this Python: (needed, the first Python that
# can install it, the error megatron raises without it). emerging_optimizers (Muon, the layer-wise
# optimizer) is plain PyTorch, and megatron-core 0.16.1, the newest release for Python 3.11, is what the
# adapter is checked against; Megatron's own top-level Muon tests skip themselves where it is absent
# ("Skip muon optimizer for LTS test"), its dist_checkpointing ones assert instead.
NOT_INSTALLABLE = "not installable on this Python: "  # starts the skip reasons of the rule below
PYTHON_GATED = [
    ("emerging_optimizers", (3, 12), re.compile(r"Emerging Optimizers is not installed|"
                                                r"No module named 'emerging_optimizers'")),
]

# (what is needed, pattern over the test's source)
SOURCE_RULES = [
    ("Transformer Engine", re.compile(r"transformer_engine|TransformerEngine|\bTE(?!ST)[A-Z][A-Za-z]*|\w*te_spec\w*")),
    ("FP8/FP4 (Transformer Engine on Hopper or later)",
     re.compile(r"\bfp[48]\s*=\s*(?!None\b|False\b)|fp8_recipe\s*=|\bFloat8|fp8_autocast|mxfp8|fp8_param\s*=\s*True")),
    ("CUDA graphs", re.compile(r"cuda_graph_impl\s*=\s*['\"](?!none)|(enable|use)_cuda_graph\s*=\s*True|"
                               r"CudaGraphManager|CudaGraphHelper|cuda_graph_helper|torch\.cuda\.(graph|CUDAGraph)\b")),
    ("Triton", re.compile(r"\btriton\b")),
    # megatron-core 0.19's DeepSeek sparse attention kernels: cuDNN frontend graphs for Hopper, TileLang
    ("cuDNN frontend (fused DSA kernels, Hopper or later)", re.compile(r"dsa_cudnn_kernels")),
    ("TileLang (DSA indexer kernels)", re.compile(r"\btilelang\b")),
    ("apex's CUDA extensions", re.compile(r"\bapex\b")),
]

# (what is needed, pattern over a parameter's name, predicate on its value)
PARAM_RULES = [
    ("Transformer Engine", re.compile(r"(^|_)te($|_)|transformer_engine"), lambda v: v is True or v == "te"),
    ("Transformer Engine", re.compile(r""), lambda v: v in ("te", "transformer_engine", "te_spec")),
    ("FP8/FP4 (Transformer Engine on Hopper or later)", re.compile(r"fp[48]"),
     lambda v: v not in (None, False, "", 0, "none")),
    ("FP8/FP4 (Transformer Engine on Hopper or later)", re.compile(r""),
     lambda v: isinstance(v, str) and re.search(r"fp[48]|e4m3|e5m2", v.lower()) is not None),
    ("CUDA graphs", re.compile(r"cuda_?graph"), lambda v: v not in (None, False, "", "none")),
]

# run-time errors that only say a CUDA-only library is missing: (what is needed, pattern)
ERROR_RULES = [
    ("Transformer Engine", re.compile(r"'>=' not supported between instances of 'NoneType' and 'Version'|"
                                      r"get_te_version\(\) [<>]|Transformer ?Engine is not installed|"
                                      r"(requires|install|needs) [Tt]ransformer[ _-]?[Ee]ngine|"
                                      r"name '(TE[A-Z]\w*|FP8GlobalStateManager|fp8_autocast|te)' is not defined|"
                                      # fp8_utils defines its fp8 helpers only when Transformer Engine imports
                                      r"module 'megatron\.core\.fp8_utils' has no attribute|"
                                      # 0.19 binds TESpecProvider to None without TE; a TE spec then calls it
                                      r"TESpecProvider\(\)[\s\S]{0,400}'NoneType' object is not callable")),
    ("apex's CUDA extensions", re.compile(r"[Aa]pex is not installed|requires [Aa]pex")),
    ("NCCL", re.compile(r"asked torch\.cuda\.nccl\b")),  # the device layer has no NCCL off CUDA
    ("grouped_gemm (CUDA kernels)", re.compile(r"Grouped GEMM is not available")),  # moe_grouped_gemm's GroupedMLP
    ("cuDNN frontend (fused DSA kernels, Hopper or later)", re.compile(r"cudnn fused DSA requires SM90\+")),
]
_NO_MODULE = re.compile(r"No module named '([A-Za-z0-9_]+)")


@functools.lru_cache(maxsize=None)
def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


_SELF_CALL = re.compile(r"\bself\.(\w+)\(")
_BARE_CALL = re.compile(r"(?<![\w.])(\w+)\(")


def code_of_test(item) -> str:
    """The test function's source, its class's set-up methods', and the helpers it calls that its own file
    defines (``self.helper(...)`` in its class, ``helper(...)`` in its module): the code that decides what
    it needs."""
    test = _source(getattr(item, "function", None))
    parts = [test]
    cls = getattr(item, "cls", None)
    if cls is not None:
        helpers = sorted(set(_SELF_CALL.findall(test)))
        for name in ["setup_method", "setup_class", "setUp", "setup", *helpers]:
            if name in vars(cls):
                parts.append(_source(vars(cls)[name]))
    module = getattr(item, "module", None)
    for name in sorted(set(_BARE_CALL.findall(test))):
        helper = vars(module).get(name) if module is not None else None
        # type(), not isinstance(): megatron's experimental_cls objects raise on any attribute, __class__ too
        if type(helper) is types.FunctionType and helper.__module__ == module.__name__:
            parts.append(_source(helper))
    return "\n".join(parts)


def _param_need(params: dict) -> str | None:
    for name, value in params.items():
        for need, name_pattern, wants in PARAM_RULES:
            try:
                hit = name_pattern.search(name) is not None and wants(value)
            except Exception:  # a value that cannot be compared (a tensor): not one of these
                hit = False
            if hit:
                return f"{need} (parameter {name}={value!r})"
    return None


def _source_need(source: str) -> str | None:
    for need, pattern in SOURCE_RULES:
        match = pattern.search(source)
        if match is not None and not _installed_for(need):
            return f"{need} (the test's code says {match.group(0).strip()!r})"
    return None


def _installed_for(need: str) -> bool:
    """Whether the library behind ``need`` is here after all (a CUDA machine running this harness)."""
    return any(_installed(module) for module, what in CUDA_ONLY_LIBRARIES.items() if need.startswith(what))


def cuda_only_need(item) -> str | None:
    """Why ``item`` cannot run without a CUDA-only library, or None when it can (as far as its code says)."""
    callspec = getattr(item, "callspec", None)
    need = _param_need(callspec.params) if callspec is not None else None
    return need or _source_need(code_of_test(item))


def missing_library(error_text: str) -> str | None:
    """What CUDA-only library a failure's text says is missing, or None (a real failure)."""
    for module in _NO_MODULE.findall(error_text):
        what = CUDA_ONLY_LIBRARIES.get(module)
        if what is not None:
            return f"{what} (No module named {module!r})"
    for need, pattern in ERROR_RULES:
        if pattern.search(error_text) and not _installed_for(need):  # with it installed: a real failure
            return f"{need} ({pattern.search(error_text).group(0)})"
    return None


def not_installable_library(error_text: str, python: tuple = sys.version_info[:2]) -> str | None:
    """What library a failure's text says is missing, when this Python cannot install it; else None."""
    for module, first_python, pattern in PYTHON_GATED:
        if python < first_python and not _installed(module) and pattern.search(error_text):
            return f"{module} needs Python >= {'.'.join(map(str, first_python))}"
    return None


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failed)\b")


def last_error_line(text: str) -> str:
    """The line that says what went wrong: pytest's last ``E`` line naming an exception (``AssertionError:
    message``), else its last ``E`` line, else the last line."""
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    named = [line for line in errors if _EXCEPTION_LINE.match(line)]
    lines = named or errors or [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no error text"


@functools.lru_cache(maxsize=None)
def asks_only_te_version(fn) -> bool:
    """A conftest fixture whose whole job is to read Transformer Engine's version (Megatron-LM's
    ``set_env``), on a machine without TE, where ``is_te_min_version`` raises."""
    return not _installed("transformer_engine") and "is_te_min_version" in _source(fn) and (
        getattr(fn, "__module__", "") or "").endswith("conftest")


def no_transformer_engine():
    """Stands for a TE-version fixture where TE is not installed: there is no TE environment to set."""
    return None
