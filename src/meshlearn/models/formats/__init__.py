"""Checkpoint file formats: each turns a file into (architecture, weights in meshlearn's names,
tokenizer) and back. No training, networking or config here: ``models/pretrained.py`` dispatches."""
