"""Rollout: SGLang-protocol client, real SGLang servers, megarl's CPU engine, and the sglang-router."""
