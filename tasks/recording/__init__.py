"""The recording stage: the immutable plan (``persist``), and what tells whether one is stored already. The
work itself lives in ``tasks.recording.record``."""
