"""Drafter training: tooling, off the serving path (nothing under lucebox/engine imports it).

trainer.py: `python -m lucebox train-drafter`, self-distillation of a DFlash drafter for a target;
data.py: its prompt sources and the held-out evaluation split.
"""
