"""Text data modules: the byte tokenizer, packed windows, local text files."""
