"""Multi-latent attention without a query LoRA as DeepSeek defines it (adapter/latent_attention.py): megatron-core
0.19's local GPT layer spec gets MLA layers that resolve that case as 0.16 - 0.18 build it (the plain query
projection, the key/value latent's own norm) where 0.19 refuses it; the same spec serves the models' flow and
Megatron-LM's ``pretrain_gpt.py`` (``--transformer-impl local``). Earlier releases need nothing there: no entry.

megatron-core 0.19's --yarn-original-max-position-embeddings, --yarn-beta-fast and --yarn-beta-slow set a GPT's YaRN,
but megatron.training leaves an MLA model's own fields of those names at MLATransformerConfig's defaults (4096,
32, 1): no flag reaches them, so DeepSeek-V3's tiny test model (64) and Kimi-K2 (beta_fast 1) could not be said.
Given, they are set on the MLA config megatron.training builds, for both entry points.

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


# Megatron-LM 0.19's YaRN flag (its argument) -> the MLATransformerConfig field it sets for an MLA model
MLA_YARN = {"yarn_original_max_position_embeddings": "original_max_position_embeddings",
            "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def _yarn_flags_for_mla(core_transformer_config_from_args):
    """The config megatron.training builds, with an MLA model's YaRN fields from the YaRN flags given."""

    @functools.wraps(core_transformer_config_from_args)
    def build(args, *rest, **kwargs):
        config = core_transformer_config_from_args(args, *rest, **kwargs)
        if getattr(args, "multi_latent_attention", False):
            for flag, field in MLA_YARN.items():
                if getattr(args, flag, None) is not None:
                    setattr(config, field, getattr(args, flag))
        return config

    return build


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
    registry.wrap("megatron.training.argument_utils:core_transformer_config_from_args", _yarn_flags_for_mla,
                  versions=_RESOLVER_VERSIONS,
                  reason="--yarn-original-max-position-embeddings / --yarn-beta-fast / --yarn-beta-slow reach no "
                         "field of an MLA model's config: set on it")
