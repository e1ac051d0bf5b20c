"""The ``"sgdtp"`` torch.compile backend and what it needs: the bucket pass that puts gradient all-reduces inside the
compiled backward (``buckets``, ``waits``, ``bucket_cost``), the sharding proof, regional compile, and the compile
cache (``cache``, ``artifacts``)."""
