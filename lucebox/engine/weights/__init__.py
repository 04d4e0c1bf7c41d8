"""Reading model files: GGUF and Hugging Face folders, config validation, and the weight types
(quantized GGUF blocks kept as stored).
"""
