"""Tools an agent calls during an episode (multi-turn GRPO): the built-in environments, and loading and checking the
user's own, for TRL's `AsyncGRPOTrainer(tools=..., environment_factory=...)`. They run in TRL's rollout child, on the
trainer's CPU."""
