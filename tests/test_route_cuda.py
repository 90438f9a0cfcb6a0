"""adapter.route_cuda: a user's own CUDA-written package routed like megatron, and nothing else touched.

The package is written here as a user would write it for CUDA; the reference for every answer is what
torch itself gives on this machine's device (cpu), and its unrouted twin shows that the same code fails
as written here, so the routing, not the code, makes it work."""

import importlib
import importlib.util
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import adapter
from adapter import cuda_routing

USER_CODE = textwrap.dedent('''
    import torch
    import torch.distributed as dist
    from torch.cuda import current_device, device_count

    SEEN_AT_IMPORT = torch.cuda.device_count()  # an import-time check, as megatron has

    def place():
        model = torch.nn.Linear(2, 2).cuda()
        moved = torch.ones(1).to("cuda")
        copied = torch.ones(1).cuda()
        made = torch.zeros(2, device="cuda:0")
        return {"model": next(model.parameters()).device.type, "to": moved.device.type,
                "cuda": copied.device.type, "factory": made.device.type, "is_cuda": copied.is_cuda,
                "device": torch.device("cuda").type, "count": device_count(), "current": current_device(),
                "type": copied.type(), "rng": torch.cuda.get_rng_state().dtype == torch.uint8,
                "indexed": torch.device("cuda", torch.cuda.current_device()).type,
                "formatted": torch.device(f"cuda:{torch.cuda.current_device()}").type,
                "emptied": torch.cuda.memory.empty_cache()}

    def built():
        # device= given to torch.nn's constructors and to a helper of this module, and no tensor method
        layer = torch.nn.Linear(2, 2, device="cuda")
        norm = torch.nn.LayerNorm(2, device=f"cuda:{0}")
        return {"layer": layer.weight.device.type, "norm": norm.weight.device.type,
                "helper": filled(device="cuda").device.type}

    def filled(device):
        return torch.full((2,), 1.0, device=device)

    def join(store):
        dist.init_process_group(backend="nccl", store=store, rank=0, world_size=1)
        try:
            return dist.get_backend()
        finally:
            dist.destroy_process_group()
''')

# a module that spells no "nccl" itself, handing on the backend its caller named (as megatron's
# HyperCommGrid does with the backend= its user gave it)
FORWARDING_CODE = textwrap.dedent('''
    import torch


    def join_with(store, backend):
        torch.distributed.init_process_group(backend=backend, store=store, rank=0, world_size=1)
        try:
            return torch.distributed.get_backend()
        finally:
            torch.distributed.destroy_process_group()
''')


# an object that raises for any attribute until a flag is set, as megatron's experimental_cls guard does
GUARDED_CODE = textwrap.dedent('''
    import torch


    class Guarded:
        def __getattribute__(self, name):
            raise RuntimeError(f"experimental: {name}")


    GUARD = Guarded()


    def moved():
        return torch.ones(1).cuda().device.type
''')


# host copies as megatron makes them before it frees a buffer (param_and_grad_buffer.offload_to_cpu)
PINNING_CODE = textwrap.dedent('''
    import torch


    def offload(buffer):
        host = buffer.cpu().pin_memory()
        staging = torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu", pin_memory=True)
        staging.copy_(buffer, non_blocking=True)
        buffer.zero_()
        return host, staging
''')


@pytest.fixture
def user_packages(tmp_path, monkeypatch):
    """Two copies of the same CUDA-written package: userpkg (to be routed) and sibling (never)."""
    for name in ("userpkg", "sibling"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "train.py").write_text(USER_CODE)
        (tmp_path / name / "grid.py").write_text(FORWARDING_CODE)
        (tmp_path / name / "guarded.py").write_text(GUARDED_CODE)
        (tmp_path / name / "pinning.py").write_text(PINNING_CODE)
        (tmp_path / name / "plain.py").write_text("import torch\n\n\ndef initialized():\n"
                                                 "    return torch.distributed.is_initialized()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    adapter.unroute_cuda("userpkg")
    for name in [n for n in sys.modules if n.partition(".")[0] in ("userpkg", "sibling")]:
        del sys.modules[name]


# current_device() is a device off an accelerator: megatron passes it as device=, and an int would
# name a CUDA device
EXPECTED = {"model": "cpu", "to": "cpu", "cuda": "cpu", "factory": "cpu", "is_cuda": True, "device": "cpu",
            "count": 1, "current": torch.device("cpu"), "type": "torch.cuda.FloatTensor", "rng": True,
            "indexed": "cpu", "formatted": "cpu", "emptied": None}


def _cuda_as_written(call):
    """Unrouted code meets the real torch.cuda: it fails where CUDA is missing (a CPU build of torch names
    CUDA, a CUDA build without a driver names the NVIDIA driver) and runs on the GPU where there is one."""
    if torch.cuda.is_available():
        return call()
    with pytest.raises((AssertionError, RuntimeError), match="(?i)cuda|nvidia"):
        call()


def _route_and_import(module: str, order: str):
    """``userpkg.<module>``, with userpkg routed before or after the import (``order``)."""
    if order == "import-then-route":
        imported = importlib.import_module(f"userpkg.{module}")
        adapter.route_cuda("userpkg")
        return imported
    adapter.route_cuda("userpkg")
    return importlib.import_module(f"userpkg.{module}")


@pytest.mark.parametrize("order", ["route-then-import", "import-then-route"])
def test_a_routed_package_runs_its_cuda_spellings_on_this_device(user_packages, order):
    train = _route_and_import("train", order)
    assert train.place() == EXPECTED
    assert train.built() == {"layer": "cpu", "norm": "cpu", "helper": "cpu"}
    assert train.join(dist.HashStore()) == "gloo"
    assert cuda_routing.routed_packages()["userpkg"] == "user"
    if order == "route-then-import":
        assert train.SEEN_AT_IMPORT == 1  # the import-time check saw the device layer (torch.cuda says 0)


@pytest.mark.parametrize("order", ["route-then-import", "import-then-route"])
def test_an_object_guarding_its_attributes_does_not_break_routing(user_packages, order):
    guarded = _route_and_import("guarded", order)
    assert guarded.moved() == "cpu"
    with pytest.raises(RuntimeError, match="experimental"):
        guarded.GUARD.anything


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pinning is real where an accelerator exists")
def test_pinned_host_copies_are_plain_host_copies_without_an_accelerator(user_packages):
    """torch refuses to pin without an accelerator; routed, the copies are made in ordinary host memory,
    still copies: megatron frees the buffer right after."""
    with pytest.raises(RuntimeError, match="(?i)accelerator|nvidia driver"):
        importlib.import_module("sibling.pinning").offload(torch.arange(4.0))
    pinning = _route_and_import("pinning", "route-then-import")
    host, staging = pinning.offload(torch.arange(4.0))
    assert host.tolist() == staging.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert not host.is_pinned() and not staging.is_pinned()


def test_nothing_outside_the_named_package_changes(user_packages):
    real_cuda, real_zeros = torch.cuda, torch.zeros
    adapter.route_cuda("userpkg")
    importlib.import_module("userpkg.train")
    sibling = importlib.import_module("sibling.train")
    assert sibling.torch is torch and sibling.current_device is torch.cuda.current_device
    assert torch.cuda is real_cuda and torch.zeros is real_zeros and sys.modules["torch.cuda"] is real_cuda
    _cuda_as_written(sibling.place)  # the same code, unrouted, runs as written
    _cuda_as_written(sibling.built)
    _cuda_as_written(lambda: torch.ones(1).cuda())  # and so does this test's own .cuda()


def test_unroute_gives_the_package_back_its_torch(user_packages):
    adapter.route_cuda("userpkg")
    train = importlib.import_module("userpkg.train")
    adapter.unroute_cuda("userpkg")
    assert train.torch is torch and train.current_device is torch.cuda.current_device
    assert "userpkg" not in cuda_routing.routed_packages()
    _cuda_as_written(train.place)


def test_cuda_calls_routes_a_scripts_own_block():
    model = torch.nn.Linear(2, 2)
    with adapter.cuda_calls():
        model.cuda()
        moved = torch.ones(1).to("cuda")
        assert moved.is_cuda
    assert next(model.parameters()).device.type == "cpu" and moved.device.type == "cpu"
    _cuda_as_written(lambda: torch.ones(1).cuda())  # outside the block, as written


@pytest.mark.parametrize("name, says", [
    ("torch", "cannot be routed"), ("os.path", "cannot be routed"), ("adapter.device", "cannot be routed"),
    ("megatron.core", "routed by `import adapter` already"), ("my-project", "not a package name"),
    ("", "not a package name")])
def test_what_cannot_be_routed_is_refused_by_name(name, says):
    with pytest.raises(ValueError, match=f"{name!r}.*{says}" if name else says):
        adapter.route_cuda(name)
    assert name not in cuda_routing.routed_packages()


def test_a_backend_name_handed_on_by_a_routed_module_is_mapped(user_packages):
    adapter.route_cuda("userpkg")
    grid = importlib.import_module("userpkg.grid")
    assert grid.join_with(dist.HashStore(), "nccl") == "gloo"
    if not torch.cuda.is_available():  # unrouted, "nccl" stays NCCL, which needs a GPU
        with pytest.raises((RuntimeError, ValueError), match="NCCL"):
            importlib.import_module("sibling.grid").join_with(dist.HashStore(), "nccl")
    # a module that hands no backend on keeps the real torch.distributed: mock.patch reaches it
    assert importlib.import_module("userpkg.plain").torch.distributed is dist


def test_no_routing_wrapper_runs_in_a_training_step(monkeypatch):
    """Routing costs nothing per layer: a forward + backward of megatron's GPT goes through none of the
    strings view's wrapped functions and enters no tensor-call mode (they serve set-up code only)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import models
    from adapter import torch_view
    from models.provider import transformer_config
    from tests.kernel_models import _gpt, _loss_and_grads
    from tests.kernel_reference import one_rank_model_parallel

    calls = []
    for view in (torch_view.routed_strings(), torch_view.routed_strings(distributed=False)):
        for name in (*torch_view._FACTORIES, "autocast", "device"):
            monkeypatch.setitem(vars(view), name, _counted(getattr(view, name), name, calls))
    monkeypatch.setattr(torch_view.CudaCalls, "__enter__", _counted(torch_view.CudaCalls.__enter__, "mode", calls))
    with one_rank_model_parallel():
        flavor = models.get("gpt-tiny")
        model = _gpt(flavor, transformer_config(flavor), get_gpt_layer_local_spec(normalization="RMSNorm"))
        tokens = torch.randint(0, flavor.vocab_size, (2, flavor.seq_length))
        assert "empty" in calls  # building the layers went through the counted view: the counter sees calls
        calls.clear()
        _loss_and_grads(model, tokens, torch.roll(tokens, -1, dims=1))
    assert calls == []


def _counted(fn, name, calls):
    def counted(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return counted


def test_a_megatron_module_added_by_a_later_release_is_routed_too(tmp_path, monkeypatch):
    """Routing is by package, not by list: a module megatron.core gains (here: one more folder on its
    __path__, as a new release's file would be) is routed when it is imported."""
    import megatron.core

    (tmp_path / "added_in_a_later_release.py").write_text(USER_CODE)
    monkeypatch.setattr(megatron.core, "__path__", [*megatron.core.__path__, str(tmp_path)])
    name = "megatron.core.added_in_a_later_release"
    try:
        added = importlib.import_module(name)
        assert added.place() == EXPECTED
        assert added.SEEN_AT_IMPORT == 1
        assert cuda_routing.is_routed(name)
    finally:
        sys.modules.pop(name, None)
        cuda_routing._ROUTED.pop(name, None)


EVENT_CODE = textwrap.dedent('''
    import torch
    from torch.cuda import Event


    class Holder:  # megatron_fsdp/experimental/module.py (0.19) annotates its class body so
        event: torch.cuda.Event | None
        stream: torch.cuda.Stream | None


    def timed():
        start, end = torch.cuda.Event(enable_timing=True), Event(enable_timing=True)
        start.record()
        end.record()
        stream = torch.cuda.Stream()
        return start, end, stream, isinstance(start, torch.cuda.Event), isinstance(stream, torch.cuda.Stream)
''')


@pytest.mark.parametrize("order", ["route-then-import", "import-then-route"])
def test_cuda_event_and_stream_stay_classes_for_annotations_and_isinstance(user_packages, tmp_path, order):
    """Routed ``torch.cuda.Event`` / ``Stream`` are types, as torch.cuda's are: ``X | None`` evaluates in a
    class body (the reference: the same annotation on torch's own class), and what they make is this
    backend's event and stream, instances of them."""
    (tmp_path / "userpkg" / "events.py").write_text(EVENT_CODE)
    events = _route_and_import("events", order)
    at_import = events.torch.cuda if order == "route-then-import" else torch.cuda  # import-time values stay
    assert events.Holder.__annotations__["event"] == (at_import.Event | None)
    assert (torch.cuda.Event | None).__args__[1] is type(None)  # what the unrouted annotation gives
    start, end, stream, is_event, is_stream = events.timed()
    assert is_event and is_stream and not isinstance(object(), events.torch.cuda.Event)
    assert start.elapsed_time(end) >= 0.0
    assert stream == adapter.device.current_stream()
    assert adapter.device.Stream.priority_range() == (0, 0)  # the CPU's one stream has one priority


def test_megatron_modules_annotating_with_cuda_events_import_under_routing():
    """0.19's megatron_fsdp evaluates ``torch.cuda.Event | None`` in a class body at import (0.16 has no
    such module: nothing to import there)."""
    import megatron.core

    experimental = "megatron.core.distributed.fsdp.src.megatron_fsdp.experimental.module"
    if importlib.util.find_spec(experimental.rpartition(".")[0]) is None:
        pytest.skip(f"megatron-core {megatron.core.__version__} has no {experimental}")
    module = importlib.import_module(experimental)
    assert cuda_routing.is_routed(experimental)
    assert module.FsdpModule.__annotations__["_unshard_event"] == (adapter.device.Event | None)
