"""The chat format: messages parsed once, their content as text, a model family's chat template rendered to prompt ids and sampled ids parsed back to messages."""
