"""The planner: a model's shapes and a run's settings in, a plan out.

- `geometry`: what the planner needs of a model, from its config alone (no weights);
- `memory`: the memory model, the predicted peak device memory of a run's process by part;
- `plan`: a plan as data (where each layer's bytes live, the ordered operations of one step) and its text;
- `inputs`: where each layer's saved input lives (device or host memory), its moves and what they cost;
- `search`: the plan a request describes (`PlanRequest`, `build_plan`);
- `budget`: the plan a run's settings ask for, or the one that copies the fewest bytes within a budget;
- `limits`: the smallest budget that holds a plan, and the longest sequence a plan fits within a budget;
- `rules`: what every plan must keep for the executor (poros/engine/methods/executor.py) to run it bitwise equal
  to resident QLoRA, checked on the plan alone, without a GPU.
"""
