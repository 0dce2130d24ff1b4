"""The reference executor: our GPT with hand-made TP / PP / DP. It runs heterogeneous plans (replicas of
different TP degrees and layer ranges) and reshapes them live through the executor protocol
(trainer/protocol.py); the native executor (trainer/native/) implements the same protocol on torch's own
parallelism."""
