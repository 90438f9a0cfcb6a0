"""Multi-latent attention without a query LoRA as DeepSeek defines it (adapter/latent_attention.py): megatron-core
0.19's local GPT layer spec gets MLA layers that resolve that case as 0.16 - 0.18 build it (the plain query
projection, the key/value latent's own norm) where 0.19 refuses it; the same spec serves the models' flow and
Megatron-LM's ``pretrain_gpt.py`` (``--transformer-impl local``). Earlier releases need nothing there: no entry.

megatron-core 0.16 decides whether Transformer Engine is there, for MLA, by importing megatron's TE extension,
which stands a ``MagicMock`` in for a missing TE and imports fine: its ``HAVE_TE`` is then True and every MLA
layer's ``isinstance(linear_proj, TELinear)`` (a mock, no type) raises ``TypeError`` at build. 0.17 takes the
extension's own ``HAVE_TE``. The module's flag is set to the kernel providers' one answer to whether TE is
importable (``cuda_provider.HAVE_TE``); it guards nothing else there.
"""

import functools

from packaging.version import Version

from adapter.kernels import cuda_provider
from adapter.registry import installed_megatron_core_version

_SPECS = "megatron.core.models.gpt.gpt_layer_specs"
_RESOLVER_VERSIONS = ">=0.19,<=0.19.2"  # megatron-core 0.19.0 brought QKNormConfigResolver
_MOCK_TE_VERSIONS = ">=0.16.1,<0.17"  # 0.17.0 imports the TE extension's own HAVE_TE


def _deepseek_queries(get_local_submodules):
    from adapter import latent_attention  # imports megatron-core: only once the spec module is imported

    return functools.wraps(get_local_submodules)(latent_attention.deepseek_queries_in(get_local_submodules))


def register(registry, versions: str) -> None:
    installed = Version(installed_megatron_core_version())
    if installed < Version("0.17"):
        registry.replace("megatron.core.transformer.multi_latent_attention:HAVE_TE", cuda_provider.HAVE_TE,
                         versions=_MOCK_TE_VERSIONS, rebind_copies=False,
                         reason="0.16's MLA takes TE's MagicMock stand-in for TE (isinstance TypeError at build): "
                                "whether TE is importable, the kernel providers' answer")
    if installed < Version("0.19"):
        return
    registry.wrap(f"{_SPECS}:get_gpt_layer_local_submodules", _deepseek_queries, versions=_RESOLVER_VERSIONS,
                  reason="MLA without q_lora_rank in the local spec: DeepSeek's plain query projection and "
                         "key/value latent norm, which 0.19's QK-norm resolver refuses (Megatron-Bridge #5261)")
