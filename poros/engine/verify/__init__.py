"""The bitwise parity gate that holds a method to resident QLoRA, and its references kept as digests."""
