#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels .ci/gpu_check.sh installs on the GPU machine, which has no
# registry: megatron-core's cp312 wheel, liger-kernel, flash-linear-attention and fla-core (the hybrid step), and
# transformers with what it requires newer than, or missing from, the machine's (shared/reference/gpu.md: torch
# 2.11, transformers 5.17; numpy, packaging, pyyaml, tqdm and torch's own requirements are there). The pins are
# the versions the CPU suite runs with (.[test] on Python 3.12). Run it on a machine with a registry before the
# device call, which then carries the folder: carry [".whl"] (about 32 MiB).
#
#   bash .ci/gpu_wheels.sh            # then: run(command="bash .ci/gpu_check.sh", carry=[".whl"])
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"

WHEELS=(
    megatron-core==0.19.2 liger-kernel==0.8.5 flash-linear-attention==0.6.0 fla-core==0.6.0
    transformers==5.24.0 huggingface-hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 regex==2026.11.19
    hf-xet==1.8.0 httpx2==2.16.2 httpcore2==2.16.2 anyio==4.16.0 h11==0.16.0 idna==3.20 truststore==0.10.5
    typer==0.29.2 click==8.5.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 shellingham==1.5.4
    annotated-doc==0.0.7 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
)
mkdir -p .whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
ls .whl | wc -l | xargs echo "wheels in .whl/:"
du -sh .whl
