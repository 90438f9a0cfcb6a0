"""Every CUDA site of megatron has a verdict, and the source-level model of the routing rule is what
routing really does.

The inventory (tests/cuda_inventory.py) reads source text; a site nothing accounts for fails the test
with its file:line, so a new megatron release shows exactly what it added. The slow test imports every
megatron.core module with and without the adapter and compares what routing wrapped with what the
source model says it wraps."""

import ast
import dis
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import importlib.metadata

import megatron.core
import pytest

import adapter
from adapter import cuda_only_features
from adapter.core_source import megatron_training
from tests import cuda_inventory, cuda_sites_table

CORE = Path(megatron.core.__file__).parent
ROOT = Path(__file__).resolve().parent.parent
RELEASE = importlib.metadata.version("megatron-core")


def _scan(package_dir: Path):
    return cuda_inventory.scan(package_dir, cuda_inventory.replaced_targets(adapter.registry))


def _training_dir() -> Path | None:
    """megatron.training's directory: the megatron-core wheel's (0.17+) or a Megatron-LM checkout's."""
    training = megatron_training()
    return training.directory if training else None


@pytest.fixture(scope="module")
def core_sites():
    return _scan(CORE)


def test_every_cuda_site_of_megatron_core_has_a_verdict(core_sites):
    assert len(core_sites) > 500  # the scan sees megatron-core's ~600 sites, not an empty tree
    unaccounted = [str(site) for site in core_sites if not site.verdict]
    assert not unaccounted, "CUDA sites nothing accounts for:\n" + "\n".join(unaccounted)


def test_every_cuda_site_of_megatron_training_has_a_verdict():
    training = _training_dir()
    if training is None:
        pytest.skip("megatron-core 0.16's megatron.training needs a Megatron-LM checkout on PYTHONPATH (README: "
                    "Megatron-LM's own pretrain_gpt.py)")
    unaccounted = [str(site) for site in _scan(training) if not site.verdict]
    assert not unaccounted, "CUDA sites nothing accounts for:\n" + "\n".join(unaccounted)


def _entries() -> list[str]:
    """Every entry that gives a verdict: the tables' keys and each feature's code entries."""
    return [*cuda_sites_table.AS_WRITTEN, *cuda_sites_table.PATCHED,
            *(code for feature in cuda_only_features.FEATURES for code in feature.code)]


def test_each_table_entry_and_feature_still_accounts_for_a_site(core_sites):
    """Checked on the releases that have the entry's site (cuda_sites_table.RELEASES); megatron.training's
    entries where megatron.training is scanned."""
    training = _training_dir()
    sites = core_sites + (_scan(training) if training else [])
    used = {site.key for site in sites}
    stale = [e for e in _entries() if e not in used and cuda_sites_table.on_release(e, RELEASE)
             and (training or not e.startswith("megatron.training"))]
    assert not stale, f"entries that match no site of megatron-core {RELEASE} (remove them, or say in " \
                      f"cuda_sites_table.RELEASES which releases have them): {stale}"


def test_release_ranges_name_entries_and_tell_the_releases_apart():
    entries = set(_entries())
    assert set(cuda_sites_table.RELEASES) <= entries
    moved = "megatron.core.transformer.mlp:apply_swiglu_sharded_factory.sh_ten_merge_fn torch.cuda.OutOfMemoryError"
    assert [cuda_sites_table.on_release(moved, r) for r in ("0.16.1", "0.17.1", "0.18.2", "0.19.2")] == [
        True, True, False, False]
    assert cuda_sites_table.on_release("megatron.core.extensions.transformer_engine", "0.19.2")


def test_patches_named_by_the_table_are_registered():
    targets = {p.target for p in adapter.registry.patches()}
    missing = [t for t in cuda_sites_table.PATCHED.values() if t not in targets]
    assert not missing, f"the inventory relies on patches that are not registered: {missing}"


def test_verdicts_of_megatron_sites_known_by_hand(core_sites):
    """A few sites whose verdict is known from reading megatron: one per rule."""
    by_place = {(s.path.removeprefix("megatron/core/"), s.function, s.spelling): s.verdict for s in core_sites}
    assert by_place[("optimizer/clip_grads.py", "clip_grad_by_total_norm_fp32",
                     "'torch.cuda.FloatTensor'")] == "routed: tensor calls"
    assert by_place[("transformer/module.py", "<module>", "torch.cuda.FloatTensor")] == "routed: device layer"
    assert by_place[("transformer/cuda_graphs.py", "_CudaGraphRunner.create_fwd_graph",
                     "torch.cuda.CUDAGraph")].startswith("refused: CUDA graphs")
    assert by_place[("tensor_parallel/random.py", "_get_cuda_rng_state", "torch.cuda.default_generators")] == (
        "patched: megatron.core.tensor_parallel.random:_get_cuda_rng_state")


FAKE_MODULE = textwrap.dedent('''
    import torch
    from torch.cuda import synchronize, CUDAGraph

    STREAM_AT_IMPORT = torch.cuda.current_stream()
    ON_IMPORT = torch.ones(1).cuda()

    def set_up(model):
        model.cuda()
        return torch.zeros(2, device="cuda"), torch.device(f"cuda:{0}")

    def step(x):
        torch.cuda.synchronize()
        return helper(x, device="cuda")

    def capture():
        return torch.cuda.CUDAGraph()

    def is_on_gpu(x):
        return x.device.type == "cuda"

    def offload(buffer, loader_cls):
        staging = torch.empty(4, pin_memory=True)
        return buffer.pin_memory(), staging, loader_cls(buffer, pin_memory=True)

    def build():
        return torch.nn.Linear(2, 2, device="cuda"), own_helper(device=f"cuda:{0}")

    def own_helper(device):
        return torch.empty(1, device=device)
''')


def test_a_new_release_shows_exactly_its_new_sites():
    """A module as a new megatron release might add: each site routed by its rule, the rest named by line."""
    sites = cuda_inventory.scan_module(FAKE_MODULE, "megatron/core/new_feature.py", "megatron.core.new_feature")
    verdicts = {(s.line, s.spelling): s.verdict for s in sites}
    assert verdicts == {
        (3, "from torch.cuda import synchronize"): "routed: device layer",
        (3, "from torch.cuda import CUDAGraph"): "",  # a CUDA class, passed through: not answered
        (5, "torch.cuda.current_stream"): "routed: device layer",
        (6, ".cuda()"): "",  # module-level tensor call: no function of the rule runs it
        (9, ".cuda()"): "routed: tensor calls",
        (10, "'cuda'"): "routed: strings view",
        (10, "'cuda:'"): "routed: strings view",
        (13, "torch.cuda.synchronize"): "routed: device layer",
        (14, "'cuda'"): "",  # device= of another module's helper: the string travels on unrouted
        (17, "torch.cuda.CUDAGraph"): "",
        (20, "'cuda'"): "",  # a device-type test must be reasoned about in the table
        (23, "pin_memory="): "routed: tensor calls",  # pinned host memory, answered where nothing pins
        (24, ".pin_memory()"): "routed: tensor calls",  # (loader_cls's keyword is its own to honour)
        (27, "'cuda'"): "routed: tensor calls",  # a torch.nn constructor's device=: its torch calls answered
        (27, "'cuda:'"): "routed: tensor calls",  # the module's own helper: its torch calls too
    }
    assert "megatron/core/new_feature.py:6: .cuda() in <module>: UNACCOUNTED" in [str(s) for s in sites]


def test_the_inventory_is_quick(core_sites):
    """It runs in every .ci/run: reading the source must stay a matter of seconds (measured: ~2 s)."""
    assert {s.path.partition("/")[0] for s in core_sites} == {"megatron"}


PROBE = textwrap.dedent('''
    import importlib, json, pkgutil, sys, warnings
    warnings.simplefilter("ignore")
    if sys.argv[1] == "adapter":
        import adapter
    import megatron.core
    ok, failed = [], {}
    for info in pkgutil.walk_packages(megatron.core.__path__, "megatron.core."):
        try:
            importlib.import_module(info.name)
            ok.append(info.name)
        except BaseException as e:  # a module that cannot import here is reported, not fatal
            failed[info.name] = f"{type(e).__name__}: {str(e)[:200]}"
    # what the walk imported, with the modules of namespace packages (no __init__.py) it cannot list
    imported = sorted(n for n in sys.modules if n.startswith("megatron.core."))
    out = {"ok": ok, "failed": failed, "imported": imported, "wrapped": []}
    if sys.argv[1] == "adapter":
        from adapter import cuda_routing
        out["wrapped"] = sorted(f"{name}:{(owner.__qualname__ + '.') if isinstance(owner, type) else ''}{attr}"
                                for name, r in cuda_routing._ROUTED.items() for owner, attr, _ in r.wrapped)
    print("RESULT " + json.dumps(out))
''')


def _probe(mode: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "ADAPTER_BACKEND": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1])


@pytest.mark.slow
def test_routing_wraps_what_the_source_model_says_and_breaks_no_import():
    routed, plain = _probe("adapter"), _probe("plain")
    broken = {m: e for m, e in routed["failed"].items() if m in plain["ok"]}
    assert not broken, f"modules that import without the adapter but not with it: {broken}"
    imported = set(routed["imported"])
    expected = {f for f in cuda_inventory.wrapped_functions(CORE, pins=True) if f.partition(":")[0] in imported}
    refused = {f for f in expected if cuda_only_features.owner(*f.split(":"), "") is not None}
    assert set(routed["wrapped"]) - expected == set()
    assert expected - refused - set(routed["wrapped"]) == set()


def _codes(code):
    yield code
    for constant in code.co_consts:
        if hasattr(constant, "co_code"):
            yield from _codes(constant)


def _tensor_method_by_dis(code) -> bool:
    """The rule's ``.cuda()`` / ``.to("cuda")`` test, read off dis.get_instructions: the reference for the
    byte-level reading cuda_routing does at import."""
    loads = ("LOAD_ATTR", "LOAD_METHOD")
    ins = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname != "EXTENDED_ARG"]
    for i, (opname, argval) in enumerate(ins):
        before, after = (ins[i - 1] if i else None), (ins[i + 1] if i + 1 < len(ins) else None)
        on_torch = before is not None and before[0].startswith("LOAD_") and before[1] == "torch"
        cuda_version = before is not None and before[0] in loads and before[1] == "version"  # torch.version.cuda
        if opname in loads and argval == "cuda" and not on_torch and not cuda_version and (
                after is None or after[0] not in loads):
            return True
        if opname in loads and argval == "to" and after and after[0] == "LOAD_CONST" and (
                after[1] in ("cuda",) or str(after[1]).startswith("cuda:")):
            return True
    return False


@pytest.mark.slow
def test_the_bytecode_rule_reads_what_dis_reads():
    from adapter import cuda_routing

    disagree, spelled = [], 0
    for file in sorted(CORE.rglob("*.py")):
        for code in _codes(compile(file.read_text(encoding="utf-8"), str(file), "exec")):
            expected = _tensor_method_by_dis(code)
            spelled += expected
            if cuda_routing._tensor_method_here(code) != expected:
                disagree.append(f"{file}: {code.co_name} (line {code.co_firstlineno})")
    assert spelled > 5 and not disagree, disagree


DEVICE_KEYWORDS = textwrap.dedent('''
    def layer():
        return torch.nn.Linear(4, 4, bias=False, device="cuda")
    def formatted(rank):
        return Linear(4, device=f"cuda:{rank}", dtype=None)
    def factory():
        return torch.zeros(3, device="cuda")
    def helper(x):
        return self.helper(x, device="cuda", other=1)
    def chosen(c):
        return self.helper(device="cuda" if c else "cpu")
    def stream():
        return torch.cuda.Stream(device="cuda")
    def in_else(x):
        if x:
            return None
        else:
            return nn.Linear(4, device="cuda")
    def parent():
        return super().__init__(4, device="cuda")
    def computed():
        return make(device=pick("cuda"))
    def on_host(x):
        return torch.zeros(3, device="cpu"), nn.Linear(2, device="cpu")
    def conditional_shape(n):
        return torch.tensor([1 if n else 0], dtype=None, device="cuda")
''')


@pytest.mark.parametrize("name", [n.name for n in ast.parse(DEVICE_KEYWORDS).body])
def test_the_device_keyword_rule_reads_what_the_source_says(name):
    """``device="cuda"`` handed to a call the strings view does not route wraps the function: the rule reads
    it off the bytecode (stack read backwards), the inventory off the source; they agree on each spelling."""
    from adapter import cuda_routing

    node = next(n for n in ast.parse(DEVICE_KEYWORDS).body if n.name == name)
    code = next(c for c in compile(DEVICE_KEYWORDS, "<snippet>", "exec").co_consts if getattr(c, "co_name", "") == name)
    expected = name in ("layer", "formatted", "helper", "in_else", "parent")
    assert cuda_inventory._tensor_calls_in(node) == expected
    assert cuda_routing.spells_tensor_calls(code) == expected
