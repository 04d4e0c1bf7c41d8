"""Attention (the one entry point and its reference) and the Triton kernels, each tested against a
plain-torch reference.
"""
