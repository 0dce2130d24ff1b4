"""Sharded analytics: shards that score whole DP replicas into summaries, and the merge that judges
each job from them with the detector's own judgement (docs/analytics-scaling.md)."""
