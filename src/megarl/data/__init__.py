"""Data: verl-format parquet datasets, tokenisation, sampling, batches, packing, tiny models.

Import the module you need; only batch.py, packing.py, preferences.py (through Batch) and
tiny_model.py import torch.

    parquet     read and validate verl-format rows (PromptRow)
    prompts     PromptDataset: rows tokenised with the chat template, overlong prompts filtered/truncated
    preferences PreferenceDataset: chosen/rejected pairs for DPO; pairs_to_batch
    sampler     EpochSampler: deterministic, resumable batches of dataset indices
    batch       Batch: padded per-sample and per-token tensors plus per-sample metadata
    packing     pack/unpack a Batch's real tokens (cu_seqlens, THD layout)
    partition   balancing across data-parallel ranks; token-budget micro-batches
    synthetic   synthetic verifiable tasks (add, rev, sort) written as verl parquet
    reasoning_gym  a reasoning-gym task written as verl parquet (megarl[envs]; docs/environments.md)
    convert     a user's JSONL question/answer file to verl parquet
    tiny_model  tiny random-weight HF checkpoints with a character-level tokenizer
    errors      DataError
"""
