"""Stand-ins for what CPU CI cannot run: PyTorch's CUDA attention ops, the flash-attn package, and a process
group that, like NCCL, takes tensors of its accelerator only (``device_group``)."""
