"""Model modules. Every supported architecture is a DecoderModel configuration."""

from lucebox.engine.models.decoder import DecoderModel

__all__ = ["DecoderModel"]
