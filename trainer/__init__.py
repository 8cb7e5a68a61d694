"""Reference GPT trainer, checkpointer, fault injection and fleet simulator."""
