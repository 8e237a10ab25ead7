"""Checkpoints with torch.distributed.checkpoint, importing nothing of the package above them but
its version: the checkpointer (checkpointer), composing its write side (saving: saves, their
commit, keep_last) and its read side (reading: finding, verifying, loading, resuming), the bytes
of a save and free space (space), host buffers of asynchronous saves (staging), failed writes by
errno (writes), and manifest.json with its format version and the upgrades of older formats
(manifest)."""
