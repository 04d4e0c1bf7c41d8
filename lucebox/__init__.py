"""Lucebox: a local LLM inference server for agent clients."""

__version__ = "0.1.0"
