"""megatron-core's Gated DeltaNet (Qwen3.5, Qwen3-Next) on the kernel provider's kernels.

``GatedDeltaNet`` imports flash-linear-attention's ``causal_conv1d``, ``l2norm`` and ``chunk_gated_delta_rule``
inside ``try``; without the library the names are None and ``HAVE_FLA`` False, and the layer refuses to be
built. A provider that supplies the three (the torch and npu providers, and the cuda one without
flash-linear-attention: adapter/kernels/gated_delta.py) has them put where the layer reads them, with
``HAVE_FLA`` True, which guards nothing else there. In 0.18 that is one module; 0.19 split it into a
package whose ``common`` holds ``l2norm`` and the check and whose ``gdn`` imports the other two by name.
Releases before 0.18 have no HybridModel, and their layer calls another library's convolution
(``causal_conv1d_fn``, Tri Dao's interface): nothing is registered there, and megatron refuses the layer.
"""

from packaging.specifiers import SpecifierSet

from adapter import kernels
from adapter.registry import installed_megatron_core_version

_GDN = "megatron.core.ssm.gated_delta_net"
# the releases of a layout -> (module, the names the layer reads there)
_LAYOUTS = {">=0.18,<0.19": ((_GDN, ("chunk_gated_delta_rule", "causal_conv1d", "l2norm", "HAVE_FLA")),),
            ">=0.19,<=0.19.2": ((f"{_GDN}.common", ("l2norm", "HAVE_FLA")),
                                (f"{_GDN}.gdn", ("chunk_gated_delta_rule", "causal_conv1d")))}


def register(registry, versions: str) -> None:
    """The installed release's layout, if it has one (0.18 and later)."""
    provider = kernels.current()
    if provider.chunk_gated_delta_rule is None:  # megatron's own: flash-linear-attention, or its refusal
        return
    installed = installed_megatron_core_version()
    for layout_versions, modules in _LAYOUTS.items():
        if not SpecifierSet(layout_versions).contains(installed, prereleases=True):
            continue
        for module, names in modules:
            for name in names:
                value = True if name == "HAVE_FLA" else getattr(provider, name)
                reason = ("GatedDeltaNet is built: its kernels are the provider's" if name == "HAVE_FLA"
                          else f"GatedDeltaNet's {name} is the {provider.NAME} provider's")
                registry.replace(f"{module}:{name}", value, versions=layout_versions, rebind_copies=False,
                                 reason=reason)
