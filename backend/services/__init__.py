"""What a user does, owner-scoped: launch, runs, queries, adapters, exports, evaluation, costs, smoke tests."""
