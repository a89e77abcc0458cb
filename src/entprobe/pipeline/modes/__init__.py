"""The two probe modes, each top to bottom in one file over the shared stages."""
