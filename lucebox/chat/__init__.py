"""Chat layer: turns conversations into prompts (chat templates) and model output back into messages."""
