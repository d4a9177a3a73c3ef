"""The DS4 memory model (placeholder while the modules move; see the next commit)."""
