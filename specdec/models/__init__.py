"""Models and their caches: presets, the converted-weights cache, loading, KV caches and batched forwards."""
