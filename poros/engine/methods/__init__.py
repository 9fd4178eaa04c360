"""The methods a matrix compares: the training-step API, resident QLoRA, the poros executor, and their registry."""
