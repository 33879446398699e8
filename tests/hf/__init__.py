"""Hugging Face models: checkpoint import/export, LoRA, the longshield-train CLI."""
