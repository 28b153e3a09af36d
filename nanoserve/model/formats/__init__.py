"""Model files: GGUF and Hugging Face loading and validation, pooling declarations, the
tokenizer and chat templates, and the one load error."""
