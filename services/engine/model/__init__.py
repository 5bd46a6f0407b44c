"""The models the engine serves: deepseek_v4/ (DeepSeek V4 and V4.1: configs, checkpoints,
the whole-sequence forward, both ledgers and the cached step)."""
