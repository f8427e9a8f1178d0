"""The trainer job: TRL's AsyncGRPOTrainer with LoRA, its callbacks, rewards, rollout loop, proxy and policy audit."""
