"""Checkpoints with torch.distributed.checkpoint, importing nothing of the package above them: saving,
verifying and resuming (checkpointer), the bytes of a save and free space (space), host buffers of
asynchronous saves (staging), and failed writes by errno (writes)."""
