"""EAGLE speculation: a one-layer head drafts from the target's own hidden states."""
