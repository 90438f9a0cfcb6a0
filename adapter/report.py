"""The environment report behind ``python -m adapter``: the first thing to paste into a bug report.

It says which backend this process got and why, the versions of everything the adapter's behaviour
depends on, which kernel provider answers each fused op and why, and what became of every registered
patch. To learn the last, it imports each megatron module a patch targets, with the registry in its
non-strict mode: a patch that cannot be applied (a missing attribute, an unchecked megatron-core, a
module that fails to import) is a row with its error, never a traceback, so one broken patch does not
hide the state of the others. Apart from that switch, the report changes nothing that ``import adapter``
and importing those megatron modules would not. Patches into megatron.training and megatron.legacy are
skipped, with why, where those packages are not importable: megatron.legacy comes only from a Megatron-LM
checkout, megatron.training from one too on megatron-core 0.16, while from 0.17 the megatron-core wheel
ships it (so a pip install applies its patches); the versions section says which source it is. An
optional patch whose module the installed release lacks (megatron.training.activation_logging before 0.18)
is skipped, with why, too. The report also lists the import stand-ins (adapter.stand_ins) and whether
each is in use.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import sys
import warnings
from types import ModuleType

import torch

import adapter
from adapter import backend as _backend
from adapter import device as _device
from adapter import cuda_routing, kernels, own_packages, quiet_warnings, stand_ins
from adapter.core_source import megatron_training
from adapter.registry import PatchRegistry

NOT_INSTALLED = "not installed"
CANN_INFO_FILES = ("*-linux/ascend_toolkit_install.info", "*-linux/ascend_all_cann_install.info", "version.cfg")
DEFAULT_CANN_HOME = "/usr/local/Ascend/ascend-toolkit/latest"

# op -> (provider attribute, what megatron runs when the provider's entry is None, what routes megatron there)
FUNCTION_OPS = {
    "rms_norm": ("rms_norm", "none (the norm module needs it)", "the norm module, normalization='RMSNorm'"),
    "layer_norm": ("layer_norm", "none (the norm module needs it)", "the norm module, normalization='LayerNorm'"),
    "swiglu": ("bias_swiglu", "fused_bias_swiglu.bias_swiglu_impl", "bias_activation_fusion=True"),
    "rope": ("rope", "rope_utils.fused_apply_rotary_pos_emb (Transformer Engine's)", "apply_rope_fusion=True"),
    "rope_thd": ("rope_thd", "rope_utils.fused_apply_rotary_pos_emb_thd (Transformer Engine's)",
                 "apply_rope_fusion=True on packed sequences"),
    "softmax": ("scaled_masked_softmax", "FusedScaleMaskSoftmax.forward_fused_softmax (apex's kernel)",
                "masked_softmax_fusion=True"),
    "cross_entropy": ("vocab_parallel_cross_entropy",
                      "fused_cross_entropy.fused_vocab_parallel_cross_entropy (native or Transformer Engine's)",
                      "cross_entropy_loss_fusion=True"),
    **{op: (attr, f"gated_delta_net's {attr} (flash-linear-attention's; without it GatedDeltaNet is refused)",
            "megatron's GatedDeltaNet (Qwen3.5, Qwen3-Next)")
       for op, attr in (("gated_delta_rule", "chunk_gated_delta_rule"), ("causal_conv1d", "causal_conv1d"),
                        ("l2norm", "l2norm"))},
}
SPEC_ROUTE = "megatron's get_gpt_layer_local_spec (LocalSpecProvider)"
# packages a megatron-core wheel may lack (megatron.training before 0.17, megatron.legacy always): patches into
# them wait for a Megatron-LM checkout
MEGATRON_LM_PACKAGES = ("megatron.training", "megatron.legacy")


# ------------------------------------------------------------------------------------------ collect
def collect(registry: PatchRegistry | None = None) -> dict:
    """The whole report as plain data (what ``--json`` prints). ``registry`` defaults to the adapter's;
    it is switched to non-strict apply and its target modules are imported."""
    registry = adapter.registry if registry is None else registry
    # megatron's import-time warnings (apex missing, deprecations) and anything a module prints stay out
    # of the report's own output: stdout may be JSON.
    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = {**backend_section(), "versions": versions(), "packages": own_packages.rows(), **kernel_section(),
                "patches": patch_rows(registry), "cuda_routing": cuda_routing.rows(), "stand_ins": stand_ins.rows(),
                "quiet_warnings": quiet_warnings.rows()}
    data["problems"] = problems(data)
    return data


def _error(exc: BaseException) -> str:
    return f"error: {type(exc).__name__}: {exc}"


def backend_section() -> dict:
    chosen = _backend.current()
    requested = os.environ.get(_backend.BACKEND_ENV, "").strip()
    why = (f"{_backend.BACKEND_ENV}={requested}" if requested.lower() not in ("", "auto")
           else f"chosen automatically, {_backend.BACKEND_ENV}{'=auto' if requested else ' unset'}")
    try:
        count, name = _device.device_count(), _device_name(chosen.name)
    except Exception as exc:  # a driver that answers the import but not the query
        count, name = _error(exc), None
    return {"backend": chosen.name, "backend_why": why, "dist_backend": chosen.dist_backend,
            "device_count": count, "device_name": name, "unavailable_backends": unavailable_backends(chosen.name)}


def _device_name(backend: str) -> str:
    if backend == "cpu":
        return platform.processor() or platform.machine()
    return getattr(torch, backend).get_device_name(0)


def unavailable_backends(chosen: str) -> dict[str, str]:
    """Why each other accelerator backend could not be used here (what automatic choice skipped)."""
    problems = {}
    if chosen != "npu":
        problems["npu"] = ("torch_npu is not installed" if not _backend._npu_installed()
                           else _backend._npu_problem() or "usable (set ADAPTER_BACKEND=npu)")
    if chosen != "cuda":
        problems["cuda"] = _backend._cuda_problem() or "usable (set ADAPTER_BACKEND=cuda)"
    return problems


# ------------------------------------------------------------------------------------------ versions
def versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda or "none (not a CUDA build)",
        "torch_npu": torch_npu_version(),
        "cann": cann_version(),
        "megatron_core": megatron_core_version(),
        "megatron_lm": megatron_lm_location(),
        "apex": apex_version(),
        "transformer_engine": distribution_version("transformer-engine", "transformer_engine"),
        "flash_attn": distribution_version("flash-attn", "flash_attn"),
    }


def distribution_version(distribution: str, module: str) -> str:
    """The installed distribution's version; a module importable without package metadata (a source
    checkout on PYTHONPATH) says so."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as exc:
        return _error(exc)
    return "present, without package metadata" if found else NOT_INSTALLED


def torch_npu_version() -> str:
    """torch_npu's version, learnt by importing it: an import failure (CANN missing or mismatched) is
    reported as the error it is."""
    if importlib.util.find_spec("torch_npu") is None:
        return NOT_INSTALLED
    try:
        module = importlib.import_module("torch_npu")
    except Exception as exc:
        return _error(exc)
    return getattr(module, "__version__", None) or distribution_version("torch-npu", "torch_npu")


def cann_version(home: str | None = None) -> str:
    """CANN's toolkit version from its install-info file or version.cfg, under ``home`` (default:
    ASCEND_TOOLKIT_HOME or ASCEND_HOME_PATH, which CANN's set_env.sh exports, else the default path)."""
    home = home or os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH") or DEFAULT_CANN_HOME
    for pattern in CANN_INFO_FILES:
        for path in sorted(glob.glob(os.path.join(home, pattern))):
            try:
                with open(path, encoding="utf-8", errors="replace") as info:
                    version = _cann_version_in(info)
            except OSError as exc:
                return _error(exc)
            if version:
                return f"{version} ({path})"
    return f"not found (no CANN install-info file or version.cfg under {home})"


def _cann_version_in(lines) -> str | None:
    """``version=8.0.RC3`` (install-info files) or ``toolkit_running_version=[7.3.0.1.231:8.0.RC2]``
    (version.cfg: internal version, then the release)."""
    for line in lines:
        key, sep, value = (part.strip() for part in line.partition("="))
        if not sep or not value:
            continue
        if key.lower() == "version":
            return value
        if key == "toolkit_running_version":
            return value.strip("[]").rpartition(":")[2]
    return None


def megatron_core_version() -> str:
    """The megatron-core distribution, else a Megatron-LM checkout's package_info."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        info = importlib.import_module("megatron.core.package_info")
    except ImportError:
        return NOT_INSTALLED
    except Exception as exc:
        return _error(exc)
    return f"{info.__version__} (from {os.path.dirname(info.__file__)}, no package metadata)"


def megatron_lm_location() -> str:
    """Where megatron.training comes from: the megatron-core wheel (0.17+) or a Megatron-LM checkout (which
    a 0.16 install needs for it, and which comes first on PYTHONPATH when there is one)."""
    try:
        training = megatron_training()
    except Exception as exc:
        return _error(exc)
    return "megatron.training not found" if training is None else str(training)


def apex_version() -> str:
    """NVIDIA apex's version, and whether its CUDA extensions (what megatron uses it for) were built. The
    PyPI package named apex is an unrelated project and has none."""
    version = distribution_version("apex", "apex")
    if version == NOT_INSTALLED or version.startswith("error"):
        return version
    if importlib.util.find_spec("fused_layer_norm_cuda") is None:
        return f"{version} (no CUDA extensions: not NVIDIA apex built with --cuda_ext)"
    return version


# ------------------------------------------------------------------------------------------ kernels
def kernel_section() -> dict:
    """This process's kernel provider, why it was chosen, and its rows (``kernel_rows``)."""
    requested = os.environ.get(kernels.KERNELS_ENV, "").strip()
    try:
        provider = kernels.current()
    except Exception as exc:
        return {"kernel_provider": {"name": None, "why": _error(exc)}, "kernels": {}}
    why = (f"{kernels.KERNELS_ENV}={requested}" if requested
           else f"default for the {_backend.current().name} backend, {kernels.KERNELS_ENV} unset")
    provider_row = {"name": provider.NAME, "why": why}
    if hasattr(provider, "FUSED"):  # the cuda provider's RMSNorm/RoPE/SwiGLU switch
        provider_row["fused_elementwise"] = f"{provider.FUSED} ({provider.FUSED_WHY})"
    return {"kernel_provider": provider_row, "kernels": kernel_rows(provider)}


def kernel_rows(provider: ModuleType) -> dict[str, dict]:
    """Per op: the implementation megatron runs with ``provider`` and why."""
    builders = {op: functools.partial(_function_row, provider, op) for op in FUNCTION_OPS}
    builders["core_attention"] = functools.partial(_core_attention_row, provider)
    builders["norm_module"] = functools.partial(_norm_module_row, provider)
    builders["grouped_gemm"] = functools.partial(_grouped_gemm_row, provider)
    builders["moe_permute"] = functools.partial(_moe_permute_row, provider)
    builders["mla_attention"] = functools.partial(_mla_attention_row, provider)
    builders["mla_rope"] = _mla_rope_row
    rows = {}
    for op, build in builders.items():
        try:
            rows[op] = {"provider": provider.NAME, **build()}
        except Exception as exc:  # a provider missing part of PROVIDER_API, a broken TE import, ...
            rows[op] = {"provider": provider.NAME, "implementation": None, "why": _error(exc)}
    return rows


def _name(obj) -> str:
    compiled = " (torch.compile'd)" if hasattr(obj, "_torchdynamo_orig_callable") else ""
    return f"{obj.__module__}.{obj.__qualname__}{compiled}"


def _function_row(provider: ModuleType, op: str) -> dict:
    attr, megatron_own, route = FUNCTION_OPS[op]
    if attr in ("rms_norm", "layer_norm") and provider.installed_norm() is not None:
        return {"implementation": _name(provider.installed_norm()),
                "why": f"Transformer Engine is installed: its norm module replaces the {provider.NAME} "
                       f"provider's, so {attr} is TE's"}
    implementation = getattr(provider, attr)
    if implementation is None:
        row = {"implementation": f"megatron's own: {megatron_own}",
               "why": f"the {provider.NAME} provider leaves it to megatron ({attr} is None); reached "
                      f"through {route}"}
    else:
        row = {"implementation": _name(implementation),
               "why": f"the {provider.NAME} provider's kernel, reached through {route}"}
    if op == "softmax":
        check = provider.softmax_fusable
        decides = "megatron's own is_kernel_available" if check is None else _name(check)
        row["why"] += f"; {decides} decides per shape whether it runs, else megatron's torch softmax"
    return row


def _core_attention_row(provider: ModuleType) -> dict:
    module = kernels.core_attention_module(provider)
    if provider.installed_core_attention() is not None:
        why = "Transformer Engine is installed: megatron's TEDotProductAttention"
    elif getattr(provider, "HAVE_FLASH_ATTN", False):
        why = (f"flash-attn {distribution_version('flash-attn', 'flash_attn')} for fp16/bf16 CUDA tensors "
               "without an explicit mask; torch's scaled_dot_product_attention otherwise")
    else:
        why = f"the {provider.NAME} provider's attention ({_name(provider.attention)})"
    return {"implementation": _name(module), "why": f"{why}; reached through {SPEC_ROUTE}"}


def _norm_module_row(provider: ModuleType) -> dict:
    module = kernels.norm_module(provider)
    why = ("Transformer Engine is installed: megatron's TENorm" if provider.installed_norm() is not None
           else f"the {provider.NAME} provider's norm (supports sequence parallel)")
    return {"implementation": _name(module), "why": f"{why}; reached through {SPEC_ROUTE} and the final "
                                                    "norm of a block"}


def _grouped_gemm_row(provider: ModuleType) -> dict:
    fc1, fc2 = kernels.grouped_linear_modules(provider)
    why = ("Transformer Engine is installed: its grouped linear layers" if provider.installed_grouped_linear()
           else f"the adapter's grouped linear layers over the {provider.NAME} provider's grouped_mm "
                f"({_name(provider.grouped_mm)})")
    return {"implementation": f"{_name(fc1)}, {_name(fc2)}",
            "why": f"{why}, in megatron's TEGroupedMLP; reached through moe_grouped_gemm=True in {SPEC_ROUTE}"}


# how each provider's core attention takes multi-latent attention's query/key heads (qk_head_dim +
# qk_pos_emb_head_dim) and narrower value heads (v_head_dim)
MLA_ATTENTION = {
    "torch": "torch's scaled_dot_product_attention, value heads of their own size",
    "npu": "npu_fusion_attention with Dq == Dk >= Dv as the op takes them (q and k zero-padded where V is wider)",
    "cuda": "torch's scaled_dot_product_attention (flash-attn 2 takes one head size: not for MLA)",
}


def _mla_attention_row(provider: ModuleType) -> dict:
    if provider.installed_core_attention() is not None:
        return {"implementation": "megatron's TEDotProductAttention",
                "why": "Transformer Engine is installed; reached through multi_latent_attention=True"}
    how = MLA_ATTENTION.get(provider.NAME, f"the {provider.NAME} provider's attention")
    return {"implementation": _name(kernels.core_attention_module(provider)),
            "why": f"{how}, given k_channels and v_channels; reached through multi_latent_attention=True in "
                   f"{SPEC_ROUTE}"}


def _mla_rope_row() -> dict:
    """MLA's fused YaRN RoPE goes by backend, not provider: megatron's Triton kernels on CUDA, their
    computation in torch elsewhere (patches/kernels.py)."""
    route = "reached through apply_rope_fusion=True with multi_latent_attention=True (MLA's YaRN RoPE)"
    backend_name = _backend.current().name
    if backend_name == "cuda":
        return {"implementation": "megatron's own: fused_mla_yarn_rope_apply (Triton)",
                "why": f"the cuda backend runs megatron's kernels; {route}"}
    return {"implementation": "adapter.kernels.mla_rope.fused_apply_mla_rope_for_q / _for_kv",
            "why": f"megatron's Triton kernels' computation in torch, bound on the {backend_name} backend; {route}"}


def _moe_permute_row(provider: ModuleType) -> dict:
    route = "reached through moe_permute_fusion=True (megatron's moe_utils.permute/unpermute)"
    if getattr(provider, "HAVE_TE", False):
        return {"implementation": "Transformer Engine's moe_permute / moe_unpermute",
                "why": f"Transformer Engine is installed: megatron binds its fused permutation; {route}"}
    return {"implementation": provider.moe_permute.__name__,
            "why": f"the {provider.NAME} provider's token permutation; {route}"}


def kernel_summary() -> str:
    """One line saying what runs in place of what megatron would warn about: the backend, each op's
    implementation and the optimizer. The pretrain flow prints it once, on rank 0."""
    import megatron.core.optimizer as optimizers

    section = kernel_section()
    ops = ", ".join(f"{op} {_short(row['implementation'])}" for op, row in section["kernels"].items())
    adam = f"{optimizers.Adam.__module__}.{optimizers.Adam.__qualname__}"
    fused = (" (fused, the adapter's)" if adam.startswith("torch.") and _backend.current().name in ("cpu", "cuda")
             and os.environ.get("ADAPTER_FUSED_ADAM") != "0" else "")
    backend = _backend.current()
    elementwise = section["kernel_provider"].get("fused_elementwise")
    elementwise = f" (RMSNorm/RoPE/SwiGLU: {elementwise})" if elementwise else ""
    return (f"[adapter] backend {backend.name} ({backend.dist_backend}); kernels from the "
            f"{section['kernel_provider']['name']} provider{elementwise}: {ops}; optimizer {adam}{fused}")


def _short(implementation: str | None) -> str:
    if implementation is None:
        return "unavailable"
    return "megatron's own" if implementation.startswith("megatron's own") else implementation.removeprefix(
        "adapter.kernels.")


# ------------------------------------------------------------------------------------------ patches
def patch_rows(registry: PatchRegistry) -> list[dict]:
    """One row per registered patch: applied, skipped (and why) or error (and the message), after
    importing every module a patch targets (``_import_targets``)."""
    registry.apply(strict=False)
    unimported = _import_targets(registry)
    rows = []
    for patch in registry.patches():
        status, detail = _outcome(registry.status(patch.target))
        if status == "pending" and patch.module in unimported:
            status, detail = unimported[patch.module]
        rows.append({"target": patch.target, "kind": patch.kind, "reason": patch.reason,
                     "versions": patch.versions, "backends": sorted(patch.backends), "status": status,
                     "why": None if status in ("applied", "error") else detail,
                     "error": detail if status == "error" else None})
    return rows


def _import_targets(registry: PatchRegistry) -> dict[str, tuple[str, str]]:
    """Import every module a patch targets; the (status, detail) of each that is not imported. Skipped, not
    errors: a module of Megatron-LM's packages where no checkout provides them (a pip install has no
    Megatron-LM), and a module the installed release lacks where only optional patches target it (say
    megatron.training.activation_logging, new in 0.18). Any other import failure is an error."""
    optional_only = {}
    for patch in registry.patches():
        optional_only[patch.module] = optional_only.get(patch.module, True) and patch.optional
    outcomes = {}
    for module in sorted(optional_only):
        package = _absent_megatron_lm_package(module)
        if package is not None:
            outcomes[module] = ("skipped", f"{package} not importable (no Megatron-LM checkout on PYTHONPATH)")
            continue
        try:
            importlib.import_module(module)
        except Exception as exc:
            # the module itself (or its package) is missing, not something it imports
            absent = isinstance(exc, ModuleNotFoundError) and (module + ".").startswith(f"{exc.name}.")
            outcomes[module] = (
                ("skipped", f"{module} is not in megatron-core {registry.megatron_version()}")
                if absent and optional_only[module]
                else ("error", f"importing {module} failed: {type(exc).__name__}: {exc}"))
    return outcomes


def _absent_megatron_lm_package(module: str) -> str | None:
    """The Megatron-LM package holding ``module``, if that package cannot be imported here."""
    for package in MEGATRON_LM_PACKAGES:
        if (module == package or module.startswith(package + ".")) and importlib.util.find_spec(package) is None:
            return package
    return None


def _outcome(status: str) -> tuple[str, str | None]:
    """Split the registry's status line: 'applied', 'pending', 'not for <backend>', 'skipped: ...' or
    'error: ...'."""
    if status == "applied":
        return status, None
    if status == "pending":
        return status, "its module was not imported"
    if status.startswith("not for "):
        return "skipped", status
    head, _, detail = status.partition(": ")
    return head, detail


def problems(data: dict) -> list[str]:
    """What the report found wrong: patch errors and anything else that reads 'error: ...'."""
    found = [f"patch {row['target']}: {row['error']}" for row in data["patches"] if row["status"] == "error"]
    found += [f"{name}: {value}" for name, value in data["versions"].items() if value.startswith("error")]
    found += [f"kernel {op}: {row['why']}" for op, row in data["kernels"].items() if row["implementation"] is None]
    if data["kernel_provider"]["name"] is None:
        found.append(f"kernel provider: {data['kernel_provider']['why']}")
    if str(data["device_count"]).startswith("error"):
        found.append(f"device count: {data['device_count']}")
    return found


# ------------------------------------------------------------------------------------------ render
def render(data: dict) -> str:
    """The report as text, one section per topic."""
    lines = ["megatron-device-adapter environment report (python -m adapter --json: the same as JSON)", ""]
    lines.append(f"backend       {data['backend']} ({data['backend_why']}); torch.distributed: "
                 f"{data['dist_backend']}")
    lines.append(f"devices       {data['device_count']}" + (f" ({data['device_name']})" if data["device_name"] else ""))
    for name, why in sorted(data["unavailable_backends"].items()):
        lines.append(f"no {name:<10} {why}")
    lines += ["", "versions"]
    width = max(map(len, data["versions"]))
    lines += [f"  {name:<{width}}  {value}" for name, value in data["versions"].items()]
    lines += ["", "packages (adapter.own_packages)"]
    lines += [f"  {row['package']:<8} {row['path']}" for row in data["packages"]]
    provider = data["kernel_provider"]
    lines += ["", f"kernels: provider {provider['name']} ({provider['why']})"]
    if provider.get("fused_elementwise"):
        lines.append(f"  RMSNorm/RoPE/SwiGLU kernels: {provider['fused_elementwise']}")
    for op, row in data["kernels"].items():
        lines.append(f"  {op:<15} {row['implementation']}")
        lines.append(f"  {'':<15} why: {row['why']}")
    counts = {s: sum(r["status"] == s for r in data["patches"]) for s in ("applied", "skipped", "pending", "error")}
    summary = f"{counts['applied']} applied, {counts['skipped']} skipped, {counts['error']} errors"
    if counts["pending"]:
        summary += f", {counts['pending']} pending"
    lines += ["", f"patches: {len(data['patches'])} registered, {summary}"]
    for row in data["patches"]:
        lines.append(f"  {row['status']:<8} {row['target']}  [{row['kind']}, {row['versions']}, "
                     f"{'/'.join(row['backends'])}]")
        lines.append(f"  {'':<8} {row['reason']}")
        if row["why"] or row["error"]:
            lines.append(f"  {'':<8} {'error' if row['error'] else 'why'}: {row['error'] or row['why']}")
    lines += ["", "CUDA routing (adapter.cuda_routing; after importing the patch targets)"]
    lines += [f"  {row['package']:<10} by {row['by']}: {row['modules']} modules routed, {row['tensor-call functions']} "
              "functions answering tensor-method spellings" for row in data["cuda_routing"]]
    if not data["cuda_routing"]:
        lines.append("  none: CUDA spellings run as written on this backend")
    lines += ["", f"import stand-ins: {len(data['stand_ins'])} (adapter.stand_ins)"]
    for row in data["stand_ins"]:
        lines.append(f"  {row['status']:<8} {row['module']}  [needs {row['requires']}, {row['versions']}]")
        lines.append(f"  {'':<8} {row['reason']}")
        lines.append(f"  {'':<8} why: {row['why']}")
    state = ("in force" if all(row["in force"] for row in data["quiet_warnings"])
             else f"not in force (-W / PYTHONWARNINGS or {quiet_warnings.SHOW_ALL_ENV})")
    lines += ["", f"warnings answered by the adapter (adapter.quiet_warnings): {state}"]
    for row in data["quiet_warnings"]:
        where = "" if row["where"] == "everywhere" else f" ({row['where']})"
        lines.append(f"  {row['action']:<8} {row['category']} from {row['module']}*: {row['message']}{where}")
        lines.append(f"  {'':<8} why: {row['why']}")
    lines.append("")
    if data["problems"]:
        lines.append(f"PROBLEMS ({len(data['problems'])}):")
        lines += [f"  - {problem}" for problem in data["problems"]]
    else:
        lines.append("no problems found")
    return "\n".join(lines)
