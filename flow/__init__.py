"""The one training flow (issue 50, prototype): what ``scripts/pretrain_gpt.py`` hands megatron.training's own
``pretrain`` — the GPT forward step, loss and dataset provider (``flow.gpt``) and ``--model NAME`` expanded into
Megatron-LM's own flags (``flow.model_flags``),
on every supported megatron-core release (``flow.releases``; before 0.19 with the GPT model provider of
``flow.gpt_model``). A layer above ``models``: it reads the named configs."""
