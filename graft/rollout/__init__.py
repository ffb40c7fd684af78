"""Rollout engines: launching inference servers and generating completions from them."""
