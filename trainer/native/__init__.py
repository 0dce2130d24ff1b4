"""The PyTorch-native executor: a Llama-style decoder parallelised with DeviceMesh, DTensor TP,
torch.distributed.pipelining and FSDP2, reshaped live (see docs/native.md)."""
