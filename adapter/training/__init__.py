"""The pretrain flow megatron-core's wheel does not ship (it has no ``megatron/training``), shaped like
Megatron-LM's: ``pretrain(train_valid_test_dataset_provider, model_provider, model_type,
forward_step_func)`` with Megatron-LM's argument names, on any backend the adapter supports."""
