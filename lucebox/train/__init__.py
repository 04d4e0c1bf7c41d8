"""Drafter training: tooling, off the serving path (nothing under lucebox/engine imports it).

command.py: `python -m lucebox train-drafter`, self-distillation of a DFlash drafter for a target (its
docstring walks through the whole pipeline), and the training run's loop;
data.py: its prompt sources and the held-out evaluation split;
examples.py: the target's own responses (the training data), generated and cached;
features.py: the frozen target's hidden states the drafter is trained on, captured once into a store;
loss.py: the training objective (block layout, masks, weighted cross-entropy through the target's head);
packed.py: the same objective for many sequences in one drafter forward (one mask rule, flex_attention on CUDA);
trainer.py: the optimizer, the training step, its benchmark and checkpoints;
checkpoint.py: checkpoints as shards of at most 16 MB and an index;
acceptance.py: tau, measured by the real decode loop and simulated from the training forward;
log.py: the command's progress lines.
"""
