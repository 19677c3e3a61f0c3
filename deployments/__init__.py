"""Ray Serve application over `actors/`: the OpenAI-compatible HTTP API (`specdec serve`)."""
