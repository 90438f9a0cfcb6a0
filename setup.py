"""Packaging for the megatron-core device adapter.

Install torch first (`pip install torch==2.13.0`); otherwise pip resolves torch itself and may pull a
multi-GB CUDA build. NVIDIA apex and torch-npu are not installable by name here: the PyPI package named
`apex` is an unrelated project, and the torch-npu wheel breaks `import torch` on machines without CANN.
Both are detected at run time when present.
"""

from setuptools import find_packages, setup

setup(
    name="megatron-device-adapter",
    version="0.1.0",
    description="Train with megatron-core, unchanged, on NVIDIA GPUs, Ascend NPUs and CPUs",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["adapter", "adapter.*", "patches", "patches.*", "models",
                                    "models.*"]),
    install_requires=[
        "torch>=2.6",
        # 0.16.1 is the newest for Python 3.10/3.11; 0.17.0 and later need Python 3.12, where pip takes 0.19.2
        "megatron-core>=0.16.1,<=0.19.2",
        "wrapt>=1.14",
        "packaging",
        "sentencepiece",
        "psutil",  # megatron's checkpoint writer needs it, without declaring it
        "numpy",
        "tqdm",  # conversion progress
    ],
    extras_require={
        # pyyaml: megatron reads per-group communicator YAML; transformers: tiny HF models to compare with
        # import-linter: the layer contracts of .importlinter (tests/test_layers.py, CI's lint job);
        # pytest-xdist: the README's test command runs the suite in three worker processes;
        # liger-kernel: the cuda provider's Triton kernels, run on CPU tensors by Triton's interpreter (Triton
        # comes with torch's CUDA build, which pip installs on Python 3.12; the 3.10/3.11 CPU build has none)
        "test": ["pytest>=7", "pytest-xdist>=3.5", "pyyaml", "transformers>=4.56", "safetensors", "tensorboard",
                 "matplotlib", "import-linter>=2.1", "liger-kernel>=0.8.5; python_version >= '3.12'", "einops"],
        # Megatron-FSDP (--use-megatron-fsdp) builds its device mesh with einops, which megatron-core does not
        # install (only its dev extra names it)
        "fsdp": ["einops"],
        # `python -m models.verify` runs the Hugging Face side of a converted checkpoint
        "hf": ["transformers>=4.56"],
        # --tensorboard-dir, and scripts/plot_loss.py drawing the curves
        "plot": ["tensorboard", "matplotlib"],
        # torch_npu must match torch and the installed CANN exactly: install Ascend's wheel for your
        # torch by hand (pip install torch-npu==<torch version>) on NPU machines only.
        "npu": ["pyyaml"],
        # NVIDIA apex is built from source (github.com/NVIDIA/apex); Transformer Engine is optional.
        # Liger-Kernel: Triton RMSNorm/SwiGLU the cuda provider picks up when installed (ADAPTER_CUDA_FUSED);
        # --no-deps keeps it from replacing torch (it asks only for torch and triton, which CUDA torch brings).
        "cuda": ["pyyaml", "liger-kernel>=0.8.5"],
        # Megatron-LM's training code and its unit tests (scripts/run_megatron_tests.py): six for its
        # tokenizers; requests and click for the data-download helper its conftest imports; pytest-mock
        # and mock for tests that import them; einops for HyperCommGrid and parallel_state; nvtx for
        # megatron's NVTX ranges (no-ops without a profiler); nltk for its tokenizer tests;
        # emerging_optimizers (plain PyTorch: Muon, the layer-wise optimizer) needs Python >= 3.12
        "megatron-lm": ["six", "requests", "click", "pytest-mock", "mock", "einops", "nvtx", "nltk",
                        "emerging_optimizers; python_version >= '3.12'"],
    },
)
