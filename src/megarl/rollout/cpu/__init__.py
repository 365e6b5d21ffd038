"""The CPU stand-in for an SGLang server: megarl's own generation engine, for machines without a GPU
(the tests, `make demo`, CPU experiments). On GPUs the rollout servers are real SGLang and nothing
here runs.

It serves the SGLang 0.5.23 endpoints and fields megarl drives, with SGLang's state rules, so the
client, the router and the weight sync (`rollout.protocol`, `rollout.control`,
`rollout.tensor_payload`, `rollout.weight_group`, `rollout.weights_checker`) work against either.
Started as `python -m megarl.rollout.cpu.server` (`rollout.launch.cpu_server_command`).

- `server`: the HTTP server (FastAPI + uvicorn) over the engine.
- `engine`: the engine: a transformers causal LM sampled in batches with continuous batching.
- `decode_rows`, `kv_cache`: the per-row state and the KV cache of the sequences decoded together.
- `lora_adapters`: LoRA adapters served as SGLang serves them, through forward hooks.
- `checkpoint_names`: a transformers model's tensors under checkpoint names (fused MoE experts).
- `route_recorder`: the routed experts of each token, from hooks on the model's routers.
"""
