"""Hugging Face safetensors <-> megatron torch_dist checkpoints, streamed tensor by tensor.

Both directions move one block of rows (at most BLOCK_BYTES) at a time: hf -> mcore reads from the
safetensors shards the rows of the checkpoint chunk the writer has reached; mcore -> hf reads a block of
the checkpoint and appends it to a safetensors shard whose header was written first. Peak memory is a few
blocks, whatever the size of the model or of the shards.

Everything that can be checked before writing is checked first (files, config, every tensor's name and
shape, the target layout), and output goes to a temporary name renamed at the end: bad input gives one
error naming the bad value, and never a half-written checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import torch

from adapter import checkpoint_dir

from . import fp8_blocks, hf_hybrid, torch_dist_io
from . import hf as hf_format
from .config import ModelConfig, ModelConfigError
from .safetensors_io import SafetensorsError, SafetensorsFile, SafetensorsStreamWriter
from .weight_mappings import LAYER_PREFIX, Copies, Mapping, per_expert

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# next to the checkpoint iterations: the HF config.json and tokenizer files the weights came with
HF_ASSETS = "hf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the most either direction holds of one tensor at a time, and the largest chunk a checkpoint written
# here has (megatron's loader, reading a region, reads each overlapping chunk whole)
BLOCK_BYTES = 32 * 2**20


class ConversionError(ValueError):
    """Input the converter refuses, with the value at fault and what to do."""


# ---------------------------------------------------------------------------------------------------------
# Hugging Face directories

class HFWeights:
    """The safetensors tensors of a HF model directory, read a block of rows at a time, under their
    language-model names: a multimodal checkpoint's ``model.language_model.*`` as ``model.*``, and what the
    language model does not use (``hf_hybrid.LEFT_BEHIND``) counted in ``left``, not read."""

    def __init__(self, directory: Path, fp8_block: int = fp8_blocks.DEFAULT_BLOCK):
        self.directory = directory
        if (directory / INDEX).is_file():
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        elif (directory / SINGLE).is_file():
            weight_map = None
        else:
            raise ConversionError(f"{directory} has no {SINGLE} or {INDEX}: point --hf-dir at a Hugging Face "
                                  "model directory saved with safetensors")
        files = sorted(set(weight_map.values())) if weight_map else [SINGLE]
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise ConversionError(f"{directory}: {INDEX} names {', '.join(missing)}, which is missing")
        self.file_of, self.shape, self.dtype, self.stored_name, self.left = {}, {}, {}, {}, {}
        for file in files:
            try:
                handle = SafetensorsFile(directory / file)
            except SafetensorsError as exc:
                raise ConversionError(str(exc)) from exc
            for stored, (dtype, shape, _) in handle.tensors.items():
                left = next((what for prefix, what in hf_hybrid.LEFT_BEHIND.items() if stored.startswith(prefix)), None)
                if left:
                    self.left[left] = self.left.get(left, 0) + 1
                    continue
                name = re.sub("^" + re.escape(hf_hybrid.MULTIMODAL_PREFIX), hf_hybrid.TEXT_PREFIX, stored)
                self.file_of[name], self.shape[name], self.dtype[name] = handle, shape, dtype
                self.stored_name[name] = stored

        self.fp8_block, self.fp8_scale_of = fp8_block, self._pair_fp8_scales(fp8_block)

    def _pair_fp8_scales(self, block: int) -> dict[str, str]:
        """FP8 weights and their block scales (``fp8_blocks``): each FP8 weight is read as bf16 and its
        ``weight_scale_inv`` is not a tensor of the model."""
        scale_of = {}
        for name in [n for n, dtype in self.dtype.items() if dtype == torch.float8_e4m3fn]:
            scale, shape = name + fp8_blocks.SCALE_SUFFIX, self.shape[name]
            if len(shape) != 2 or self.shape.get(scale) != fp8_blocks.scale_shape(shape, block):
                raise ConversionError(
                    f"{name} is FP8 {shape} but {scale} is {self.shape.get(scale, 'missing')}: an FP8 weight "
                    f"needs its {block}x{block} block scales {fp8_blocks.scale_shape(shape, block)} "
                    "(quantization_config.weight_block_size in config.json)")
            scale_of[name], self.dtype[name] = scale, torch.bfloat16
        for scale in scale_of.values():
            del self.shape[scale], self.dtype[scale]
        return scale_of

    def _read(self, name: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        return self.file_of[name].read_rows(self.stored_name[name], start, stop)

    def get(self, name: str) -> torch.Tensor:
        return self.get_rows(name, 0, self.shape[name][0]) if name in self.fp8_scale_of else self._read(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name not in self.fp8_scale_of:
            return self._read(name, start, stop)
        scale = self.fp8_scale_of[name]
        return fp8_blocks.dequantize_rows(lambda a, b: self._read(name, a, b), lambda a, b: self._read(scale, a, b),
                                          start, stop, self.fp8_block)

    def dequantized_line(self) -> str | None:
        """One line on the FP8 weights read as bf16, if any."""
        if not self.fp8_scale_of:
            return None
        return (f"{self.directory}: dequantized {len(self.fp8_scale_of)} FP8 (e4m3) weights with their "
                f"{self.fp8_block}x{self.fp8_block} block scales (weight_scale_inv) to bf16")

    def left_line(self) -> str | None:
        """One line on what the conversion leaves, if anything."""
        if not self.left:
            return None
        return (f"{self.directory}: converting the language model; left "
                + ", ".join(f"{what} ({count} tensors)" for what, count in self.left.items()))


def read_hf_config(hf_dir: Path) -> tuple[dict, ModelConfig]:
    """(config.json, as its language model's where it is multimodal; the ModelConfig of it)."""
    if not hf_dir.is_dir():
        raise ConversionError(f"--hf-dir {hf_dir} does not exist")
    path = hf_dir / CONFIG
    if not path.is_file():
        raise ConversionError(f"{hf_dir} has no {CONFIG}: point --hf-dir at a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path} is not valid JSON: {exc}") from exc
    try:
        return hf_hybrid.language_model_config(raw), hf_format.config_from_hf(raw)
    except hf_format.UnsupportedCheckpoint as exc:
        raise ConversionError(f"{path}: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Site:
    """One megatron tensor a mapping converts: the checkpoint tensor ``key`` at the leading indices
    ``prefix`` (the layer and expert axes megatron prepends, where it does), ``shape`` below them; ``layer``
    is megatron's layer, ``hf_layer`` the HF layer it is part of (a hybrid model has two per HF layer)."""
    key: str
    prefix: tuple[int, ...]
    shape: tuple[int, ...]
    mapping: Mapping
    layer: int | None = None
    expert: int | None = None
    hf_layer: int | None = None

    def hf_names(self) -> list[str]:
        return self.mapping.hf_names("" if self.hf_layer is None else str(self.hf_layer),
                                     "" if self.expert is None else str(self.expert))

    def hf_tensors(self, model: ModelConfig) -> list[tuple]:
        """(HF name, shape, this site, index in the mapping) of each HF tensor this site writes."""
        return [(name, shape, self, index) for index, (name, shape) in enumerate(
            zip(self.hf_names(), self.mapping.hf_shapes(model, self.shape)))]


# a per-layer key of a model whose layers differ (dense and MoE): the layer is in the name, not an axis
_NUMBERED_LAYER = re.compile(re.escape(LAYER_PREFIX) + r"(\d+)\.(.+)")
# a multi-token prediction layer's key: counted after the decoder's layers
_MTP_LAYER = re.compile(r"mtp\.layers\.(\d+)\.(.+)")


def _locate(entry, model: ModelConfig) -> tuple[str, int | None, tuple[int, ...]]:
    """(name relative to the layer, layer, leading indices) of a ShardedTensor of megatron's layout; MTP layer k
    is layer ``megatron_num_layers + k``."""
    prefix = tuple(entry.global_offset[:entry.prepend_axis_num])
    numbered = _NUMBERED_LAYER.fullmatch(entry.key)
    if numbered:
        return numbered[2], int(numbered[1]), prefix
    mtp = _MTP_LAYER.fullmatch(entry.key)
    if mtp:
        return mtp[2], model.megatron_num_layers + int(mtp[1]), prefix
    if entry.key.startswith(LAYER_PREFIX):
        return entry.key[len(LAYER_PREFIX):], prefix[0], prefix
    return entry.key, None, prefix


def _plan(model: ModelConfig, architecture: str, layout: list) -> tuple[list[tuple], list[Site]]:
    """(checkpoint entry, site) for every tensor megatron checkpoints, and every site in save_pretrained's
    order (embeddings, each layer, final norm and output layer); refuses a layout the mapping does not cover
    exactly (a megatron version whose keys moved)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    known = hf_format.ARCHITECTURES[architecture]
    whole, layers = known.whole(model), known.layers(model)
    sites, plan = {}, []
    for entry in (e for e in layout if isinstance(e, ShardedTensor)):
        name, layer, prefix = _locate(entry, model)
        hf_layer, mappings = (None, whole) if layer is None else layers[layer]
        mapping = next((m for m in mappings if m.megatron == name), None)
        if mapping is None:
            raise ConversionError(f"megatron checkpoints {entry.key!r}, which the {architecture} mapping "
                                  "does not produce: this megatron-core version is not supported")
        expert = prefix[-1] if per_expert(mapping) else None
        site = sites.setdefault((name, layer, expert), Site(
            entry.key, prefix, tuple(entry.global_shape[len(prefix):]), mapping, layer, expert, hf_layer))
        plan.append((entry, site))
    expected = [(m.megatron, None, None) for m in whole if m.megatron.startswith("embedding.")]
    for layer, (_, mappings) in enumerate(layers):
        for m in mappings:
            experts = range(model.num_experts) if per_expert(m) else [None]
            expected += [(m.megatron, layer, expert) for expert in experts]
    expected += [(m.megatron, None, None) for m in whole if not m.megatron.startswith("embedding.")]
    unused = [site for site in expected if site not in sites]
    if unused or len(expected) != len(sites):
        raise ConversionError(f"the {architecture} mapping produces {unused[:3]} (name, layer, expert), which "
                              "megatron does not checkpoint: this megatron-core version is not supported")
    return plan, [sites[site] for site in expected]


def _hf_tensors(model: ModelConfig, sites: list[Site]) -> list[tuple]:
    """Every HF tensor in save_pretrained's order: (name, shape, site, index in its mapping)."""
    return [tensor for site in sites for tensor in site.hf_tensors(model)]


# ---------------------------------------------------------------------------------------------------------
# HF -> megatron

def _check_layout(model: ModelConfig, tp: int, pp: int, ep: int = 1) -> None:
    for name, value in (("--tp", tp), ("--pp", pp), ("--ep", ep)):
        if not isinstance(value, int) or value < 1:
            raise ConversionError(f"{name} {value!r}: must be a positive integer")
    try:
        model.check_layout(tp, pp, ep=ep)
    except ModelConfigError as exc:
        raise ConversionError(str(exc)) from exc


# recomputed from the config (old checkpoints saved RoPE's inverse frequencies), or a tied copy
_IGNORED_HF_TENSOR = re.compile(r"rotary_emb\.inv_freq$|^lm_head\.weight$")


def _check_hf_tensors(weights: HFWeights, expected: list[tuple]) -> None:
    missing = [name for name, *_ in expected if name not in weights.shape]
    fused = sorted(name for name in weights.shape if name.endswith(".experts.gate_up_proj"))
    if missing and fused:
        raise ConversionError(f"{weights.directory} holds each layer's experts fused ({fused[0]}), not one tensor "
                              "per expert as checkpoints on the hub and transformers' save_pretrained store them: "
                              "load it in transformers and save_pretrained it again")
    if missing:
        raise ConversionError(f"{weights.directory} lacks {len(missing)} tensor(s) its config.json implies, "
                              f"e.g. {', '.join(missing[:3])}")
    for name, shape, *_ in expected:
        if weights.shape[name] != tuple(shape):
            raise ConversionError(f"{name} has shape {weights.shape[name]} in {weights.directory}, but "
                                  f"config.json implies {tuple(shape)}: the weights and config.json "
                                  "disagree")
    extra = sorted(name for name in set(weights.shape) - {name for name, *_ in expected}
                   if not _IGNORED_HF_TENSOR.search(name))
    if extra:
        raise ConversionError(f"{weights.directory} has tensor(s) the conversion would drop, e.g. "
                              f"{', '.join(extra[:3])}: this is not a plain {len(expected)}-tensor model")


def _check_copies(weights: HFWeights, sites: list[Site]) -> None:
    """Every further copy of a tensor HF stores several times (``Copies``: an MTP layer's embedding and output
    head) equals the first, compared a block of rows at a time: megatron keeps one."""
    for site in (s for s in sites if isinstance(s.mapping, Copies)):
        first, *others = site.hf_names()
        for start, count in _row_blocks(weights.shape[first], weights.dtype[first]):
            block = weights.get_rows(first, start, start + count)
            differs = next((o for o in others if not torch.equal(weights.get_rows(o, start, start + count), block)),
                           None)
            if differs:
                raise ConversionError(f"{differs} differs from {first} in {weights.directory}: megatron's MTP layer "
                                      "shares the model's embedding and output layer, so it cannot hold a copy "
                                      "of its own")


def hf_to_mcore(hf_dir, save_dir, tp: int = 1, pp: int = 1, dtype: str | None = None,
                progress: bool = True, ep: int = 1) -> Path:
    """Convert a HF directory of a supported architecture (``hf.ARCHITECTURES``) into a megatron torch_dist
    release checkpoint in ``save_dir`` (loadable with ``--load save_dir`` at any TP/PP/EP; ``tp``/``pp``/
    ``ep`` are checked against the model and recorded as the layout it was converted for). Returns the
    checkpoint directory."""
    hf_dir, save_dir = Path(hf_dir), Path(save_dir)
    from megatron.core.dist_checkpointing import ShardedObject

    raw_config, model = read_hf_config(hf_dir)
    architecture = raw_config["architectures"][0]
    _check_layout(model, tp, pp, ep)
    try:
        block = fp8_blocks.block_size(raw_config)
    except ValueError as exc:
        raise ConversionError(f"{hf_dir / CONFIG}: {exc}") from exc
    weights = HFWeights(hf_dir, block)
    with torch_dist_io.single_process_groups():
        layout = torch_dist_io.megatron_layout(model)
    plan, sites = _plan(model, architecture, layout)
    expected = _hf_tensors(model, sites)
    _check_hf_tensors(weights, expected)
    if (save_dir / checkpoint_dir.TRACKER).exists() or (save_dir / checkpoint_dir.RELEASE).exists():
        raise ConversionError(f"{save_dir} already holds a checkpoint: choose an empty --save-dir")
    _check_copies(weights, sites)
    for line in (weights.left_line(), weights.dequantized_line()):
        if line:
            print(line, file=sys.stderr)
    cast = _dtype(dtype)

    def target(site: Site) -> torch.dtype:  # each tensor keeps its dtype unless --dtype casts them all
        return cast or weights.dtype[site.hf_names()[0]]

    bar = _progress(progress, sum(_nbytes(e.local_shape, target(site)) for e, site in plan), "hf -> mcore")
    rows = _row_reader(weights, model, bar)
    chunks = []
    for entry, site in plan:
        axis = entry.prepend_axis_num
        for start, count in _row_blocks(entry.local_shape, target(site)):
            offset = list(entry.global_offset)
            offset[axis] += start
            shape = (1,) * axis + (count, *entry.local_shape[1:])
            chunks.append(torch_dist_io.tensor_chunk(entry.key, entry.global_shape, offset, shape, target(site),
                                             rows(site, entry.global_offset[axis] + start, count, shape,
                                                  target(site))))
    chunks += [torch_dist_io.object_chunk(entry.unique_key, entry.data) for entry in layout
               if isinstance(entry, ShardedObject)]
    common = {"checkpoint_version": checkpoint_dir.CHECKPOINT_VERSION, "iteration": 0,
              "model_config": dataclasses.asdict(model), "hf_architecture": architecture,
              "converted_for": {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                "expert_model_parallel_size": ep}}
    save_dir.mkdir(parents=True, exist_ok=True)
    _copy_assets(hf_dir, save_dir / HF_ASSETS, with_config=True)
    with torch_dist_io.single_process_groups():
        path = torch_dist_io.write_checkpoint(save_dir, chunks, common)
    bar.close()
    return path


def _row_reader(weights: HFWeights, model: ModelConfig, bar):
    """``rows(site, first, count, shape, target)``: a function producing rows [first, first + count) of
    ``site``'s megatron tensor, reshaped to ``shape``, as ``target``, when the writer reaches them: read
    straight from the one HF tensor that holds them where there is one, else built whole once (QKV)."""
    cache: dict = {}

    def rows(site: Site, first: int, count: int, shape: tuple, target: torch.dtype):
        def produce():
            names = site.hf_names()
            for index, name in enumerate(names):
                span = site.mapping.row_range(index, site.shape[0])
                if span and span[0] <= first and first + count <= span[0] + span[1]:
                    block = weights.get_rows(name, first - span[0], first - span[0] + count)
                    break
            else:
                if cache.get("site") != site:
                    cache.update(site=site, tensor=site.mapping.to_megatron([weights.get(n) for n in names], model))
                block = cache["tensor"][first:first + count]
            block = block.to(target).reshape(shape)
            bar.update(block.numel() * block.element_size())
            return block
        return produce

    return rows


# ---------------------------------------------------------------------------------------------------------
# megatron -> HF

def mcore_to_hf(load_dir, save_dir, iteration=None, model: ModelConfig | None = None,
                dtype: str | None = None, max_shard_bytes: int = 5 * 2**30, tokenizer_dir=None,
                progress: bool = True) -> Path:
    """Write the model weights of a megatron torch_dist checkpoint (saved at any TP/PP/EP) as a HF
    safetensors directory with config.json and tokenizer files. The model's config comes from, in
    order: ``model``; the config.json the checkpoint was converted from; its common state."""
    load_dir, save_dir = Path(load_dir), Path(save_dir)
    try:
        checkpoint = checkpoint_dir.iteration_dir(load_dir, iteration)
    except checkpoint_dir.CheckpointError as exc:
        raise ConversionError(str(exc)) from exc
    if save_dir.exists() and any(save_dir.iterdir()):
        raise ConversionError(f"--save-dir {save_dir} is not empty: choose a new directory")
    assets = load_dir / HF_ASSETS
    raw_config = None
    if model is None and (assets / CONFIG).is_file():
        raw_config, model = read_hf_config(assets)
    if model is None:
        model = _stored_model(checkpoint)
    architecture = raw_config["architectures"][0] if raw_config else hf_format.architecture_for(model)
    with torch_dist_io.single_process_groups():
        plan, sites = _plan(model, architecture, torch_dist_io.megatron_layout(model))
        stored = _stored_tensors(checkpoint, plan)
        cast = _dtype(dtype)
        target = cast or stored["embedding.word_embeddings.weight"].dtype  # config.json's dtype

        def dtype_of(site: Site) -> torch.dtype:  # each tensor keeps its dtype unless --dtype casts them all
            return cast or stored[site.key].dtype

        config = raw_config or hf_format.config_to_hf(model, architecture, target)
        if dtype is not None:  # transformers < 5 reads torch_dtype, 5 writes dtype
            name = str(target).removeprefix("torch.")
            config = {**config, "torch_dtype": name, **({"dtype": name} if "dtype" in config else {})}
        hf_tensors = _hf_tensors(model, sites)
        shards = _shard(hf_tensors, dtype_of, max_shard_bytes)
        partial = save_dir.with_name(f".{save_dir.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        try:
            bar = _progress(progress, sum(_nbytes(s, dtype_of(site)) for _, s, site, _ in hf_tensors), "mcore -> hf")
            _write_hf(checkpoint, model, hf_tensors, shards, partial, stored, dtype_of, bar)
            bar.close()
            (partial / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            _copy_assets(Path(tokenizer_dir) if tokenizer_dir else assets, partial, with_config=False)
            if save_dir.exists():
                save_dir.rmdir()
            partial.rename(save_dir)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
    return save_dir


def _stored_tensors(checkpoint: Path, plan: list[tuple]) -> dict:
    """The checkpoint's tensor metadata, once every tensor the model has is checked to be there in the
    model's global shape (a checkpoint of another model is refused before anything is written)."""
    stored = torch_dist_io.tensors_metadata(checkpoint)
    for entry in {entry.key: entry for entry, _ in plan}.values():
        if entry.key not in stored:
            raise ConversionError(f"{checkpoint} has no {entry.key!r}: it is not a checkpoint of this model")
        if tuple(stored[entry.key].global_shape) != tuple(entry.global_shape):
            raise ConversionError(f"{entry.key} is {tuple(stored[entry.key].global_shape)} in {checkpoint}, the "
                                  f"model implies {tuple(entry.global_shape)}: pass the right --model")
    return stored


def _stored_model(checkpoint: Path) -> ModelConfig:
    """The ModelConfig a checkpoint written by this project records in its common state."""
    try:
        stored = checkpoint_dir.read_common(checkpoint).get("model_config")
        return ModelConfig(**stored)
    except (pickle.UnpicklingError, TypeError, ModelConfigError) as exc:  # not ours, or from elsewhere
        raise ConversionError(f"{checkpoint} does not say which model it holds ({type(exc).__name__}): "
                              "pass --model NAME") from exc


def _shard(hf_tensors: list[tuple], dtype_of, max_bytes: int) -> list[list[str]]:
    """HF tensor names grouped into files of at most ``max_bytes`` (a bigger tensor gets a file alone)."""
    shards, current, size = [], [], 0
    for name, shape, site, _ in hf_tensors:
        nbytes = _nbytes(shape, dtype_of(site))
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    return shards + [current]


def _write_hf(checkpoint, model, hf_tensors, shards, out: Path, stored, dtype_of, bar) -> None:
    files = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    shape_of = {name: shape for name, shape, *_ in hf_tensors}
    dtype_by_name = {name: dtype_of(site) for name, _, site, _ in hf_tensors}
    writers = iter(list(zip(files, shards)))
    reader = torch_dist_io.checkpoint_reader(checkpoint)
    writer, file_of, total, whole = None, {}, 0, {}
    for name, shape, site, index in hf_tensors:
        if writer is None or writer.complete:
            if writer is not None:
                writer.close()
            file, names = next(writers)
            writer = SafetensorsStreamWriter(out / file, [(n, dtype_by_name[n], shape_of[n]) for n in names],
                                             metadata={"format": "pt"})
            file_of.update({n: file for n in names})
        source, dtype = stored[site.key].dtype, dtype_by_name[name]
        lead, rest = site.prefix, site.shape[1:]
        span = site.mapping.row_range(index, site.shape[0])
        if span is not None:  # a row range of the megatron tensor: copied over in blocks
            for start, count in _row_blocks((span[1], *rest), source):
                region = (lead + (span[0] + start,) + (0,) * len(rest), (1,) * len(lead) + (count, *rest), source)
                block = torch_dist_io.read_regions(reader, {site.key: region})[site.key]
                writer.write(name, block.reshape(count, *rest).to(dtype))
        else:  # rows scattered over the megatron tensor (QKV): read it whole once for its parts
            if whole.get("site") != site:
                whole = {"site": site, "parts": site.mapping.to_hf(_whole_tensors(reader, site, stored), model)}
            writer.write(name, whole["parts"][index].to(dtype))
        nbytes = _nbytes(shape, dtype)
        total += nbytes
        bar.update(nbytes)
    writer.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(file_of.items()))}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _whole_tensors(reader, site: Site, stored: dict) -> list[torch.Tensor]:
    """The megatron tensors of ``site`` whole, at its leading indices: its own, or every section's of a
    module checkpointed in sections."""
    keys = site.mapping.megatron_keys(site.key)
    lead = site.prefix
    regions = {key: (lead + (0,) * (len(stored[key].global_shape) - len(lead)),
                     (1,) * len(lead) + tuple(stored[key].global_shape[len(lead):]), stored[key].dtype) for key in keys}
    tensors = torch_dist_io.read_regions(reader, regions)
    return [tensors[key].reshape(regions[key][1][len(lead):]) for key in keys]


def _row_blocks(shape: tuple, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(start, count) row blocks of a tensor of ``shape``, each of at most BLOCK_BYTES (at least a row):
    the unit both directions stream in, and the chunk size of the checkpoints written here."""
    row_bytes = _nbytes(shape[1:], dtype)
    step = max(1, BLOCK_BYTES // row_bytes)
    return [(start, min(step, shape[0] - start)) for start in range(0, shape[0], step)]


# ---------------------------------------------------------------------------------------------------------

def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ConversionError(f"--dtype {name!r}: use one of {', '.join(DTYPES)} (or leave it out to keep "
                              "the checkpoint's)")
    return DTYPES[name]


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def _copy_assets(source: Path, destination: Path, with_config: bool) -> None:
    if not source.is_dir():
        return
    names = TOKENIZER_FILES + ((CONFIG,) if with_config else ())
    files = [source / n for n in names if (source / n).is_file()]
    if files:
        destination.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.copy2(file, destination / file.name)


def _progress(enabled: bool, total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                disable=not enabled, mininterval=1.0)
