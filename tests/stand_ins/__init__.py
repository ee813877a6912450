"""Stand-ins for what CPU CI cannot run: PyTorch's CUDA attention ops and the flash-attn package."""
