"""The engine: codecs, policies, the compressed cache, generation. Imports torch and transformers only."""
