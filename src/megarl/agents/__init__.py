"""Agentic rollouts: the user's own async code drives the policy through an OpenAI-compatible
endpoint for as many turns as it likes; megarl records every call token-in/token-out and trains
on whole trajectories.

    records.py     the calls of each trajectory, and the per-episode turn/token limits
    trajectory.py  one episode's calls -> one (prompt, response, loss mask, log-probs) row, exactly
    openai_api.py  OpenAI request parsing and response/chunk bodies (pure)
    endpoint.py    the FastAPI/uvicorn server in front of the rollout client
    loader.py      importing the user's `run_episode`
    runner.py      running episodes concurrently and building the training Batch
    judge.py       LLM-as-judge: the judge prompt, its output parser, and the group scorer
"""
