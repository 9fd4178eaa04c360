"""The engine, by concern (each folder imports only those listed after it):

- `verify`: the bitwise parity gate (a method against resident QLoRA) and its references kept as digests;
- `methods`: the methods (resident QLoRA, the poros executor) and their registry;
- `runtime`: what the executor runs a plan with (device buffers, layer runners and templates, saved inputs);
- `model`: the trainable QLoRA model and how its layers compute (attention, chunks, kept attention, compilation);
- `parallel`: data parallelism over torch.distributed, and the launcher's environment;
- `planning`: the planner (a model's shapes and a run's settings in, a plan out).
"""
