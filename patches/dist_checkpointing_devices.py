"""megatron's distributed checkpointing places exchange buffers on "cuda" through helpers of other modules;
on cpu and npu they go to this backend's device."""


def register(registry, versions: str) -> None:
    pass
