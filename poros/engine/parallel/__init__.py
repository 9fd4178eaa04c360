"""Data parallelism over torch.distributed, and what a launcher tells a process through its environment."""
