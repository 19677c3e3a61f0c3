"""The engine: requests, the batch scheduler, the in-process engine and its backends, prompts and text out."""
