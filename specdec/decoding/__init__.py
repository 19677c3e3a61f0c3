"""The decoding algorithm: proposers, verification, sampling, logits processing, structured output, speculation length, statistics."""
