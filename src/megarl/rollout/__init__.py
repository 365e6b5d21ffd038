"""Rollout: SGLang-protocol client, real SGLang servers, and the sglang-router; megarl's CPU
engine, the stand-in for SGLang without a GPU, is the subpackage `rollout.cpu`."""
