"""The trainable QLoRA model and how its layers compute: attention, chunks, kept attention, compilation."""
