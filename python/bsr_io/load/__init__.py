"""The load path: discovery, the window of W slots, reads, install into destinations."""
