"""The data half of the pretrain flow, with Megatron-LM's interfaces: the GPT dataset provider, the pretraining
data loader and ``get_batch``.

Datasets are megatron-core's own (GPTDataset, MockGPTDataset, BlendedDataset through
BlendedMegatronDatasetBuilder); its index helpers are the C++ extension compiled into the wheel, so nothing here
builds them. As in Megatron-LM, only the ranks that feed the model read data: tensor-parallel rank 0 of the first
and last pipeline stages. They build the datasets (global rank 0 first, the others then read its cached indices)
and load batches; ``get_batch`` broadcasts each batch to the rest of the tensor-parallel group.
"""

from __future__ import annotations

import argparse
import datetime
import logging

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.utils import get_batch_on_this_cp_rank, log_single_rank
from packaging.version import Version

from adapter import device
from adapter.registry import installed_megatron_core_version
from adapter.corpus_check import check_files
from adapter.training.data_check import check_corpora
from adapter.training.global_vars import get_args, get_tokenizer

logger = logging.getLogger(__name__)

_INT_KEYS = ["tokens", "labels", "position_ids"]
# megatron-core 0.18 gave get_batch_on_this_cp_rank a required ``is_hybrid_cp`` (this_cp_rank_part)
_HYBRID_CP_ARGUMENT = Version(installed_megatron_core_version()) >= Version("0.18")


# ---------------------------------------------------------------- datasets
def is_dataset_built_on_rank() -> bool:
    """The ranks that read data: tensor-parallel rank 0 of the first and the last pipeline stage."""
    return ((parallel_state.is_pipeline_first_stage(ignore_virtual=True)
             or parallel_state.is_pipeline_last_stage(ignore_virtual=True))
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def gpt_dataset_config(args: argparse.Namespace, tokenizer) -> GPTDatasetConfig:
    """megatron-core's dataset config from Megatron-LM's argument names."""
    mock = getattr(args, "mock_data", False)
    blend = None if mock else _blend(getattr(args, "data_path", None))
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        split=args.split,
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        path_to_cache=getattr(args, "data_cache_path", None),
        tokenizer=tokenizer,
        reset_position_ids=getattr(args, "reset_position_ids", False),
        reset_attention_mask=getattr(args, "reset_attention_mask", False),
        eod_mask_loss=getattr(args, "eod_mask_loss", False),
        create_attention_mask=_creates_attention_mask(args),
    )


def _blend(data_path):
    """``--data-path`` as megatron's blend: [prefix, ...] or [weight, prefix, weight, prefix, ...] (a string is
    split at spaces, as a shell variable would be). Every prefix must name an existing .bin/.idx pair, checked
    here so that a typo is not a failure deep inside the builder."""
    if not data_path:
        raise ValueError("no training data: pass --data-path PREFIX (see scripts/preprocess_data.py) "
                         "or --mock-data for synthetic tokens")
    blend = get_blend_from_list(data_path.split() if isinstance(data_path, str) else list(data_path))
    for prefix in blend[0]:
        check_files(prefix)
    return blend


def _creates_attention_mask(args: argparse.Namespace) -> bool:
    """Off unless asked for (``--create-attention-mask-in-dataloader``): the models the flow trains are causal,
    and causal attention never reads the [s, s] mask (megatron's Transformer Engine attention ignores it too).
    Made, it is a [1, s, s] tensor per sample for the loader to build, pin, copy up and broadcast every step."""
    return getattr(args, "create_attention_mask_in_dataloader", False)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Megatron-LM's GPT dataset provider: (train, valid, test) datasets of at least the given numbers of
    samples. Called on every rank (``is_distributed``); ranks that read no data get None. The corpora are
    checked first (``data_check.check_corpora``): a bad one stops every rank here, before the first step."""
    args = get_args()
    config = gpt_dataset_config(args, get_tokenizer())
    if not config.mock:
        check_corpora(config.blend[0], args.padded_vocab_size, getattr(args, "check_token_ids", True),
                      datetime.timedelta(minutes=args.distributed_timeout_minutes))
    dataset_type = MockGPTDataset if config.mock else GPTDataset
    log_single_rank(logger, logging.INFO, f"building {dataset_type.__name__} train, validation and test datasets")
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, is_dataset_built_on_rank,
                                        config).build()


train_valid_test_datasets_provider.is_distributed = True


# ---------------------------------------------------------------- samplers and loader
class _MicroBatches:
    """The shared shape of both orders: global batches of ``micro_batch_size x data_parallel_size`` samples,
    of which this data-parallel rank takes its consecutive slice of one micro-batch."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if micro_batch_size < 1 or not 0 <= data_parallel_rank < data_parallel_size or consumed_samples < 0:
            raise ValueError(f"micro_batch_size {micro_batch_size} must be positive, data_parallel_rank "
                             f"{data_parallel_rank} within data_parallel_size {data_parallel_size} and "
                             f"consumed_samples {consumed_samples} not negative")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch = micro_batch_size * data_parallel_size
        self.rank_offset = data_parallel_rank * micro_batch_size

    def _starts(self, begin: int, end: int) -> range:
        """Where this rank's micro-batch starts in each whole global batch between begin and end."""
        return range(begin + self.rank_offset, end - self.global_batch + self.rank_offset + 1, self.global_batch)


class PretrainingSampler(_MicroBatches):
    """Megatron-LM's "single" order: the samples in index order (GPTDataset shuffles them itself), starting
    after ``consumed_samples``, so a resumed run reads exactly the batches an uninterrupted one would have read.
    An incomplete last global batch is dropped."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples >= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} leaves nothing of a dataset of "
                             f"{total_samples} samples; build the dataset with more samples")

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_batch

    def __iter__(self):
        for start in self._starts(self.consumed_samples, self.total_samples):
            yield list(range(start, start + self.micro_batch_size))


class CyclicPretrainingSampler(_MicroBatches):
    """Megatron-LM's "cyclic" order: epoch after epoch over the dataset, each epoch in its own random order drawn
    from ``seed + epoch``, starting after ``consumed_samples``. Endless, so the train loop needs no re-iteration;
    each epoch uses the largest whole number of global batches."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, seed: int):
        super().__init__(total_samples, consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.epoch_samples = total_samples - total_samples % self.global_batch
        if self.epoch_samples == 0:
            raise ValueError(f"a dataset of {total_samples} samples holds no global batch of {self.global_batch}")
        self.seed = seed

    def __iter__(self):
        epoch, begin = divmod(self.consumed_samples, self.epoch_samples)
        while True:
            order = torch.randperm(self.epoch_samples, generator=torch.Generator().manual_seed(self.seed + epoch))
            for start in self._starts(begin, self.epoch_samples):
                yield order[start:start + self.micro_batch_size].tolist()
            epoch, begin = epoch + 1, 0


def build_pretraining_data_loader(dataset, consumed_samples: int, args: argparse.Namespace):
    """A DataLoader over this data-parallel rank's micro-batches of ``dataset`` in ``args.dataloader_type`` order
    ("single" or "cyclic"), resuming after ``consumed_samples``; None for no dataset, as Megatron-LM."""
    if dataset is None:
        return None
    sampler_args = (len(dataset), consumed_samples, args.micro_batch_size,
                    parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())
    kind = getattr(args, "dataloader_type", "single")
    if kind == "single":
        sampler = PretrainingSampler(*sampler_args)
    elif kind == "cyclic":
        sampler = CyclicPretrainingSampler(*sampler_args, seed=args.seed)
    else:
        raise ValueError(f"--dataloader-type {kind!r} is not supported; use single or cyclic")
    workers = getattr(args, "num_workers", 2)
    # the loader draws its workers' base seed from a generator of its own: from the default one it would take a
    # draw that a resumed run (its RNG states restored before the loaders are built) takes again, shifting what
    # dropout draws on a CPU, where dropout and the loader share that generator
    seeds = torch.Generator().manual_seed(args.seed)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=workers, generator=seeds,
                                       pin_memory=device.has_accelerator(), persistent_workers=workers > 0)


# ---------------------------------------------------------------- batches
def get_batch(data_iterator, vp_stage=None):
    """Megatron-LM's GPT batch: (tokens, labels, loss_mask, attention_mask, position_ids) on this backend's
    device, the same on every rank of the tensor-parallel group: its rank 0 reads the next batch and broadcasts
    it. Stages between the first and the last take no data: all None. attention_mask is None when the data
    loader makes none (``create_attention_mask_in_dataloader`` off).

    Under context parallelism every CP rank of a data-parallel rank has read the same batch (the sampler
    deals by data-parallel rank alone); each keeps its part of the sequence as megatron splits it
    (``get_batch_on_this_cp_rank``: chunks r and 2CP-1-r of 2CP, so the causal work is balanced), the
    attention mask's query rows with them."""
    if not (parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)):
        return None, None, None, None, None
    batch = this_cp_rank_part(_broadcast_batch(data_iterator, _creates_attention_mask(get_args())))
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"), batch["position_ids"]


def this_cp_rank_part(batch: dict) -> dict:
    """This context-parallel rank's part of ``batch`` as megatron splits it: sequence chunks r and 2CP-1-r of 2CP.

    The CP group is passed on every release. Up to 0.17, ``get_batch_on_this_cp_rank(batch)`` finds parallel_state's
    CP group itself. From 0.18 it takes a required ``is_hybrid_cp``; False keeps the static CP group of the flow.
    Its whole-sequence split then sizes the split by ``cp_group``, and with None that is the world group, not
    the CP group: at TP2 x CP2 it would cut each sequence in eight."""
    group = parallel_state.get_context_parallel_group()
    if _HYBRID_CP_ARGUMENT:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(batch, cp_group=group)


def _batch_layout(args: argparse.Namespace, with_attention_mask: bool) -> dict:
    """Each key of a batch: its shape and the dtype it travels in (the boolean mask as uint8, which every
    collective library carries)."""
    tokens = (args.micro_batch_size, args.seq_length)
    layout = {key: (tokens, torch.int64) for key in _INT_KEYS} | {"loss_mask": (tokens, torch.float32)}
    if with_attention_mask:
        layout["attention_mask"] = ((args.micro_batch_size, 1, args.seq_length, args.seq_length), torch.uint8)
    return layout


def _broadcast_batch(data_iterator, with_attention_mask: bool) -> dict:
    """The tensor-parallel group's batch on this backend's device. Rank 0 reads it and copies it up without
    blocking (the loader pins it where there is an accelerator); above TP 1 it broadcasts each tensor in the
    shape every rank knows from the arguments, as Megatron-LM's get_batch does. megatron's broadcast_data
    would first broadcast the sizes and read them back to the host, a sync and a loop of scalar reads per
    call, and copy the batch up twice."""
    layout = _batch_layout(get_args(), with_attention_mask)
    target = device.torch_device()
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        data = next(data_iterator)
        _check_batch_shapes(data, layout)
        batch = {key: data[key].to(target, dtype, non_blocking=True) for key, (_, dtype) in layout.items()}
    else:
        batch = {key: torch.empty(shape, dtype=dtype, device=target) for key, (shape, dtype) in layout.items()}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        source = parallel_state.get_tensor_model_parallel_src_rank()
        for key in layout:
            torch.distributed.broadcast(batch[key], source, group=parallel_state.get_tensor_model_parallel_group())
    if with_attention_mask:
        batch["attention_mask"] = batch["attention_mask"].bool()
    return batch


def _check_batch_shapes(data: dict, layout: dict) -> None:
    """The loader's batch in the shapes the other tensor-parallel ranks receive into, or one clear error
    here instead of a broadcast that would hang or mix data."""
    for key, (shape, _) in layout.items():
        if key not in data or tuple(data[key].shape) != shape:
            got = tuple(data[key].shape) if key in data else "nothing"
            raise ValueError(f"the data loader's batch has {got} for {key!r}, where --micro-batch-size and "
                             f"--seq-length make {shape}: the dataset's samples must be --seq-length tokens")
