"""DFlash speculation: a block drafter fills a whole block from the target's own hidden states in one forward."""
