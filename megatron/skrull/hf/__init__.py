"""Hugging Face interop: config.json <-> model flags, safetensors <-> mcore GPTModel weights."""
