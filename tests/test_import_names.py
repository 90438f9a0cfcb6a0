"""A user's training script beside its project's own ``models/`` and ``patches/`` packages: ``import
adapter`` works whichever is imported first, the user's packages keep their names untouched, and the
adapter's are ``adapter.models`` / ``adapter.patches``; the pretrain flow runs from such a script."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import adapter
from adapter import own_packages
from tests.distributed import ROOT, free_port

CHECKS = """
assert models.USER and patches.USER, "the user's own packages"
assert adapter.models.get("qwen2.5-tiny").num_layers == 4
from adapter.models.provider import make_model_provider
assert adapter.import_own("models.provider").make_model_provider is make_model_provider
import megatron.core.tensor_parallel.random as random_module
assert adapter.registry.status("megatron.core.tensor_parallel.random:_get_cuda_rng_state") == "applied"
print("ok", models.__file__, adapter.models.__name__, adapter.patches.__name__)
"""

FLOW = """
import functools

import torch
from megatron.core.enums import ModelType

from adapter.models.provider import make_model_provider
from adapter.training.data import get_batch, train_valid_test_datasets_provider
from adapter.training.global_vars import get_args
from adapter.training.pretrain import pretrain, transformer_config_overrides


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    provider = make_model_provider(get_args().model_config, **transformer_config_overrides(get_args()))
    return provider(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)


def loss_func(loss_mask, output):
    total = torch.sum(output.float().view(-1) * loss_mask.view(-1).float())
    count = loss_mask.sum().to(torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), loss_mask.sum().float()])}


def forward_step(data_iterator, model):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    return model(tokens, position_ids, attention_mask, labels=labels), functools.partial(loss_func, loss_mask)


pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
         argv="--model qwen2.5-tiny --micro-batch-size 2 --global-batch-size 2 --seq-length 32 --train-iters 2 "
              "--lr 1e-3 --mock-data --eval-iters 0 --log-interval 1 --hidden-dropout 0 --attention-dropout 0".split())
"""


def _project(tmp_path, script: str, models_as_file: bool = False):
    """A user's project: its own models and patches, and ``train.py`` beside them."""
    if models_as_file:
        (tmp_path / "models.py").write_text("USER = True\n")
    else:
        (tmp_path / "models").mkdir()
        (tmp_path / "models" / "__init__.py").write_text("USER = True\n")
    (tmp_path / "patches").mkdir()
    (tmp_path / "patches" / "__init__.py").write_text("USER = True\n")
    (tmp_path / "train.py").write_text(textwrap.dedent(script))


def _run(tmp_path) -> subprocess.CompletedProcess:
    """``python train.py`` from the project, the adapter importable as if installed (its checkout on
    PYTHONPATH, after the script's own directory, as site-packages would be)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("order, models_as_file", [
    ("import models, patches\nimport adapter\n", False),
    ("import adapter\nimport models, patches\n", False),
    ("import adapter\nimport models, patches\n", True),
], ids=["theirs first", "adapter first", "a models.py file"])
def test_the_users_packages_and_the_adapters_live_side_by_side(tmp_path, order, models_as_file):
    _project(tmp_path, order + CHECKS, models_as_file)
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    user_models = tmp_path / ("models.py" if models_as_file else "models/__init__.py")
    assert done.stdout.split() == ["ok", str(user_models), "adapter.models", "adapter.patches"]


@pytest.mark.slow
def test_the_pretrain_flow_runs_from_a_script_beside_its_own_models_and_patches(tmp_path):
    _project(tmp_path, "import models, patches\nimport adapter\nassert models.USER\n" + FLOW)
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "iteration        2/       2" in done.stdout
    assert done.stdout.count("[adapter] backend cpu (gloo); kernels from the torch provider") == 1
    assert "Traceback" not in done.stderr and "Falling back" not in done.stderr


def test_without_a_clash_the_plain_names_are_the_adapters():
    assert [row["imported as"] for row in own_packages.rows()] == ["patches", "models"]
    assert adapter.import_own("models") is sys.modules["models"]
    assert adapter.import_own("models.checkpoint") is sys.modules["models.checkpoint"]
    assert not hasattr(adapter, "models")  # only a clash makes adapter.models
