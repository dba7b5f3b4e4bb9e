"""The batcher's collaborators: admission, room making, the batch policy, a round's plan."""
